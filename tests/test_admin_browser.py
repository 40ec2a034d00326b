"""trio-nsqadmin's page in a real headless Chromium (the OS package, driven by Selenium): the topic and its
channel with the right depth, a pause clicked on the page reaching the broker, a live graph drawn.

`.ci/run` installs Chromium and its driver (Debian's `chromium` and `chromium-driver`); on a machine
without them these tests say so and do not run.
"""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest

from nsq_raw import RawNSQ, take
from processes import AdminProcess, BrokerProcess, LookupdProcess, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("no Chromium and chromedriver on this machine (Debian: apt-get install chromium chromium-driver); "
                "the browser tests of trio-nsqadmin did not run", allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("admin-web")
    lookupd = LookupdProcess(base, broadcast_address="127.0.0.1").start()
    # with retention every message is kept in the topic's log, so a seek can deliver it again
    broker = BrokerProcess(base, lookupd_tcp_address=lookupd.tcp_address, broadcast_address="127.0.0.1",
                           retention_time="1h").start()
    admin = AdminProcess(base, lookupd_http_address=lookupd.http_address).start()
    yield lookupd, broker, admin
    for daemon in (admin, broker, lookupd):
        daemon.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def publish(broker: BrokerProcess, topic: str, n: int) -> None:
    assert broker.http.post(f"/mpub?topic={topic}", content=b"\n".join(b"m%d" % i for i in range(n))).text == "OK"


def text_of(browser, css: str) -> str:
    """The first match's text. The page redraws its tables every refresh: an element found just before a
    redraw is gone when its text is asked for, so it is found again."""
    for _ in range(5):
        found = browser.find_elements(By.CSS_SELECTOR, css)
        try:
            return found[0].text if found else ""
        except StaleElementReferenceException:
            continue
    return ""


def test_the_topic_page_shows_depth_pauses_the_broker_and_draws_graphs(cluster, browser, tmp_path):
    lookupd, broker, admin = cluster
    broker.http.post("/topic/create?topic=web")
    broker.http.post("/channel/create?topic=web&channel=web-ch")
    publish(broker, "web", 7)
    wait_for(lambda: lookupd.get("/lookup?topic=web").status_code == 200, timeout=10, message="lookupd knows web")

    browser.get(f"{admin.http_url}/topics/web")
    wait_for(lambda: text_of(browser, 'tr[data-channel="web-ch"] td.depth') == "7", timeout=15,
             message="the channel row with depth 7")
    assert text_of(browser, "[data-topic]") == "web"
    # nothing finished yet: no delivery-to-FIN figures, and the oldest of the seven waiting has an age
    assert text_of(browser, 'tr[data-channel="web-ch"] td.fin') == "— / —"
    assert re.fullmatch(r"[0-9.]+ (s|min|h)", text_of(browser, 'tr[data-channel="web-ch"] td.age'))

    # live graphs: keep publishing while the page polls; the published-rate line gets points and a height
    def drawn() -> bool:
        publish(broker, "web", 50)
        lines = browser.find_elements(By.CSS_SELECTOR, '[data-graph="published /s"] polyline')
        points = lines[0].get_attribute("points").split() if lines else []
        return len(points) >= 3 and len({p.split(",")[1] for p in points}) > 1
    wait_for(drawn, timeout=30, interval=1.0, message="the published /s graph to draw")
    browser.save_screenshot(str(tmp_path / "topic.png"))
    assert (tmp_path / "topic.png").stat().st_size > 10_000
    if os.environ.get("TRIO_NSQ_SCREENSHOT"):  # how docs/admin-topic.png is made
        browser.save_screenshot(os.environ["TRIO_NSQ_SCREENSHOT"])

    # the channel page: click pause, see the broker's channel paused and the page say so
    browser.find_element(By.CSS_SELECTOR, 'tr[data-channel="web-ch"] a').click()
    wait_for(lambda: text_of(browser, "[data-channel-name]") == "web-ch", timeout=10, message="the channel page")
    browser.find_element(By.CSS_SELECTOR, 'button[data-act="pause"]').click()

    def paused_on_broker() -> bool:
        topics = broker.http.get("/stats?format=json&topic=web").json()["topics"]
        return topics[0]["channels"][0]["paused"]
    wait_for(paused_on_broker, timeout=10, message="the broker's channel paused")
    wait_for(lambda: "channel web/web-ch paused" in text_of(browser, "#status"), timeout=10,
             message="the action's result on the page")
    wait_for(lambda: "paused" in text_of(browser, "h1"), timeout=10, message="the paused tag")
    assert browser.find_element(By.CSS_SELECTOR, 'button[data-act="unpause"]')


def test_the_channel_page_seeks_and_shows_the_lag(cluster, browser):
    """Drained, then sought back to the earliest message from the page: the broker's channel has every
    message to deliver again, and the page's depth and lag say so."""
    lookupd, broker, admin = cluster
    broker.http.post("/topic/create?topic=again")
    broker.http.post("/channel/create?topic=again&channel=r")
    publish(broker, "again", 6)
    take(broker.tcp_address, "again", "r", 6)
    wait_for(lambda: broker.http.get("/stats?format=json&topic=again").json()["topics"][0]["channels"][0]["lag_messages"] == 0,
             timeout=10, message="the channel drained")
    wait_for(lambda: lookupd.get("/lookup?topic=again").status_code == 200, timeout=10, message="lookupd knows again")
    browser.get(f"{admin.http_url}/topics/again/r")
    wait_for(lambda: text_of(browser, "[data-channel-name]") == "r", timeout=15, message="the channel page")
    assert text_of(browser, "tr.total td.lag") == "0"
    # the six FINs' delivery-to-FIN figures: their count and each percentile
    assert text_of(browser, "tr.total td.fins") == "6"
    for cell in ("fin-p5", "fin-p9", "fin-p99", "fin-p999"):
        assert re.fullmatch(r"[0-9.]+ (ns|µs|ms|s)", text_of(browser, f"tr.total td.{cell}")), cell
    browser.find_element(By.CSS_SELECTOR, "button[data-act-seek]").click()  # "the earliest message kept"
    browser.switch_to.alert.accept()

    def sought() -> bool:
        return broker.http.get("/stats?format=json&topic=again").json()["topics"][0]["channels"][0]["depth"] == 6
    wait_for(sought, timeout=10, message="the broker's channel sought back")
    wait_for(lambda: text_of(browser, "tr.total td.depth") == "6" and text_of(browser, "tr.total td.lag") == "6",
             timeout=10, message="the page showing it")
    assert "sought to earliest" in text_of(browser, "#status")


def test_the_channel_page_sets_max_attempts_shows_dead_letters_and_redrives(cluster, browser):
    """Max attempts typed into the channel's settings form reach the broker; a message requeued past them
    shows as dead-lettered on the page, and the page's re-drive brings it back to the channel."""
    lookupd, broker, admin = cluster
    broker.http.post("/topic/create?topic=poison")
    broker.http.post("/channel/create?topic=poison&channel=w")
    wait_for(lambda: lookupd.get("/lookup?topic=poison").status_code == 200, timeout=10, message="lookupd knows poison")
    browser.get(f"{admin.http_url}/topics/poison/w")
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, 'form[data-settings] input[name="max_attempts"]'),
             timeout=15, message="the settings form")
    field = browser.find_element(By.CSS_SELECTOR, 'form[data-settings] input[name="max_attempts"]')
    assert field.get_attribute("placeholder") == "0"  # the flag's, shown while nothing is set
    time.sleep(2.5)  # a redraw between: what is typed into the form stays
    field = browser.find_element(By.CSS_SELECTOR, 'form[data-settings] input[name="max_attempts"]')
    field.send_keys("2")
    browser.find_element(By.CSS_SELECTOR, "button[data-save-settings]").click()
    wait_for(lambda: broker.http.get("/channel/config?topic=poison&channel=w").json()["config"] == {"max_attempts": 2},
             timeout=10, message="the broker's channel set")
    wait_for(lambda: "settings saved" in text_of(browser, "#status"), timeout=10, message="the save on the page")
    publish(broker, "poison", 1)
    with RawNSQ(broker.tcp_address) as conn:
        conn.sub("poison", "w")
        conn.rdy(1)
        for _ in range(2):
            [msg] = conn.expect_messages(1, timeout=10)
            conn.req(msg.id, 0)
        conn.nop()
    wait_for(lambda: text_of(browser, "[data-dead-letters] tr.total td.dead") == "1", timeout=15,
             message="the dead letter on the page")
    browser.find_element(By.CSS_SELECTOR, "button[data-redrive]").click()
    wait_for(lambda: "re-drove 1 messages" in text_of(browser, "#status"), timeout=10, message="the re-drive's result")
    wait_for(lambda: text_of(browser, "tr.total td.depth") == "1", timeout=10, message="the message back in its channel")
    # the page's look at the channel's messages: the re-driven one queued, attempts reset
    browser.find_element(By.CSS_SELECTOR, '[data-message-states] button[data-state="queued"]').click()
    wait_for(lambda: "m0" in text_of(browser, "table[data-messages] tbody"), timeout=10,
             message="the queued message listed on the page")
    assert text_of(browser, "table[data-messages] tbody td:nth-child(3)") == "0"


def test_the_nodes_page_marks_each_broker(cluster, browser):
    _, broker, admin = cluster
    browser.get(f"{admin.http_url}/nodes")
    row = f'tr[data-node="127.0.0.1:{broker.http_port}"]'
    wait_for(lambda: "up" in text_of(browser, row), timeout=15, message="the broker marked up")
    time.sleep(0.1)
    assert "not answering" not in text_of(browser, row)


def test_a_replicated_topics_page_shows_its_replicas(browser, tmp_path):
    """trio-nsqd in cluster mode (docs/cluster.md): the topic's page has a table of its replicas, the leader
    tagged, each in sync with its epoch and high watermark; a follower killed is marked unreachable."""
    import base64

    import httpx
    from etcd_server import EtcdServer

    with EtcdServer(tmp_path) as etcd:
        lookupd = LookupdProcess(tmp_path, broadcast_address="127.0.0.1").start()
        flags = dict(lookupd_tcp_address=lookupd.tcp_address, broadcast_address="127.0.0.1", replicas=3, min_isr=2,
                     etcd_endpoints=etcd.endpoint, etcd_lease_ttl="2s", replica_lag_time="2s")
        brokers = [BrokerProcess(tmp_path, **flags).start() for _ in range(3)]
        admin = AdminProcess(tmp_path, lookupd_http_address=lookupd.http_address).start()
        try:
            leader, followers = brokers[0], brokers[1:]
            keys = {"key": base64.b64encode(b"/trio-nsq/brokers/").decode(),
                    "range_end": base64.b64encode(b"/trio-nsq/brokers0").decode(), "count_only": True}
            wait_for(lambda: int(httpx.post(f"{etcd.endpoint}/v3/kv/range", json=keys).json().get("count", 0)) == 3,
                     timeout=15, message="three brokers in etcd")
            time.sleep(1.5)  # and in the first one's view of them, which it re-reads at least every second
            assert leader.http.post("/topic/create?topic=rep").status_code == 200
            publish(leader, "rep", 3)
            wait_for(lambda: lookupd.get("/lookup?topic=rep").status_code == 200, timeout=10, message="lookupd knows rep")
            end = leader.http.get("/stats?format=json&topic=rep").json()["topics"][0]["replication"]["log_end"]

            browser.get(f"{admin.http_url}/topics/rep")
            row = 'tr[data-replica="{}"] td.{}'.format
            wait_for(lambda: all(text_of(browser, row(b.http_address, "hwm")) == f"{end:,}" for b in brokers),
                     timeout=15, message="every replica's high watermark at the log end")
            assert text_of(browser, "[data-leader]") == leader.http_address
            assert text_of(browser, "[data-epoch]") == "1"
            assert sorted(text_of(browser, "[data-isr]").split(", ")) == sorted(b.http_address for b in brokers)
            assert text_of(browser, f'tr[data-replica="{leader.http_address}"] td:first-child').endswith("leader")
            assert [text_of(browser, row(b.http_address, "role")) for b in brokers] == ["leader", "follower", "follower"]
            assert all(text_of(browser, row(b.http_address, "in-isr")) == "yes" for b in brokers)

            followers[1].kill()
            gone = f'tr[data-replica="{followers[1].http_address}"] td:first-child'
            wait_for(lambda: text_of(browser, gone).endswith("unreachable"), timeout=15,
                     message="the killed follower marked unreachable")
        finally:
            for daemon in (admin, *brokers, lookupd):
                daemon.stop()
