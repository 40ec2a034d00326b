"""The PySpark connector: `df.write.format("nsq")` and `df.writeStream.format("nsq")` publish rows to NSQ
through nsqd's `POST /mpub?binary=true`; `spark.readStream.format("nsq")` and `spark.read.format("nsq")`
read a topic's log by position on trio-nsqd (mode=log), or consume a channel (mode=channel).

    from trio_nsq.spark import NSQDataSource
    spark.dataSource.register(NSQDataSource)

With the package installed normally (not editable), no call is needed: Spark finds the top-level module
`pyspark_nsq`, which exports this class as DefaultSource. See trio_nsq/spark/README.md.

Modules: options (checked at planning time; the choice of reader), rows (Arrow rows to message bodies),
publisher (batches and HTTP, plain Python), datasource (the Spark classes), positional (the readers by
position) and log_client (their HTTP client for trio-nsqd's /log API, and discovery), source (the channel
stream reader), fetcher (its connections and held messages, on a Trio thread), batch (the channel batch
reader).
"""

__all__ = ["NSQDataSource"]


def __getattr__(name: str):
    # pyspark is an optional extra: import it only when the data source is asked for
    if name == "NSQDataSource":
        from trio_nsq.spark.datasource import NSQDataSource

        return NSQDataSource
    raise AttributeError(name)
