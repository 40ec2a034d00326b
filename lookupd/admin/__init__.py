"""trio-nsqadmin: nsqadmin (nsqadmin/ in nsqio/nsq) on our stack, reading the cluster through lookupd.

options (nsqadmin's flags), cluster (what nsqd and nsqlookupd answer, aggregated as nsqadmin's
clusterinfo does), api (nsqadmin 1.3.0's JSON API and actions, and the page), nsqadmin (NSQAdmin: the
HTTP server's owner), static/ (the page: plain HTML, JS and CSS, with live graphs drawn from successive
polls of the API).
"""
