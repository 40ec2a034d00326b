"""shared/options.py and broker/options.py against nsqd's nsqd/options.go, apps/nsqd/options.go and
mreiferson/go-options (how a --config TOML value is resolved: flag > config file > default)."""

from __future__ import annotations

import hashlib
import math
import re
import socket
import zlib
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_nsq.broker.options import Options, parse_options
from trio_nsq.shared.options import format_duration, parse_duration

# --- parse_duration (Go's time.ParseDuration, plus plain seconds) ----------------------------------


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("1m30s", 90.0),
        ("250ms", 0.25),
        ("2h", 7200.0),
        ("1.5s", 1.5),
        ("10", 10.0),
        ("0", 0.0),
        ("0s", 0.0),
        ("1h15m30.5s", 4530.5),
        ("100ns", 1e-7),
        ("300us", 3e-4),
        ("300µs", 3e-4),
        ("1.s", 1.0),
        (".5s", 0.5),
        ("-1.5h", -5400.0),
        ("+5m", 300.0),
        ("2h45m", 9900.0),
        ("1m0.001s", 60.001),
        ("15m", 900.0),
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds, abs=1e-12)


@pytest.mark.parametrize("value, seconds", [(10, 10.0), (0.25, 0.25), (0, 0.0)])
def test_parse_duration_of_numbers_is_seconds(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize(
    "text",
    ["", " ", "abc", "s", "ms", "1x", "10 s", "1m30", "1h-5m", "-", "+", "1.2.3s", "1e", "h1", "1sm",
     "1S", "1M", "1H", "1d", "1w", "1m 30s", "one second"],
)
def test_parse_duration_refuses_invalid_strings(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_parse_duration_refuses_what_go_refuses_and_a_timeout_cannot_be():
    """Go's ParseDuration refuses every one of these; here they come back as nan / inf / 3.0 / -1.0
    (Python's float() and the regex's Unicode \\d accept them, lstrip("+-") eats any number of signs),
    so `--msg-timeout=nan` would start a broker whose timeouts never compare true."""
    accepted = {}
    for text in ["nan", "NaN", "inf", "-inf", "infinity", "\u0663s", "\u0661\u0660", "--1s", "+-1s"]:
        try:
            accepted[text] = parse_duration(text)
        except ValueError:
            pass
    assert accepted == {}


_UNIT_SECONDS = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


@given(st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(sorted(_UNIT_SECONDS))), min_size=1, max_size=5))
def test_parse_duration_sums_its_parts(parts):
    text = "".join(f"{n}{unit}" for n, unit in parts)
    expected = sum(n * _UNIT_SECONDS[unit] for n, unit in parts)
    assert parse_duration(text) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_format_duration_reads_back():
    for seconds in (0.0, 0.025, 0.25, 1.0, 2.0, 60.0, 900.0, 3600.0):
        assert parse_duration(format_duration(seconds)) == pytest.approx(seconds)
    assert format_duration(0.25) == "250ms" and format_duration(60.0) == "1m0s"
    assert format_duration(3661.5) == "1h1m1.5s" and format_duration(0.0015) == "1.5ms"


# --- defaults ---------------------------------------------------------------------------------------


def _go_default_node_id() -> int:
    # nsqd.NewOptions: crc32.ChecksumIEEE(md5(hostname)) % 1024
    return zlib.crc32(hashlib.md5(socket.gethostname().encode()).digest()) % 1024


# nsqd.NewOptions(), in our units (durations in seconds)
NSQD_DEFAULTS = {
    "log_level": "info",
    "log_prefix": "[nsqd] ",
    "tcp_address": "0.0.0.0:4150",
    "http_address": "0.0.0.0:4151",
    "broadcast_tcp_port": 0,
    "broadcast_http_port": 0,
    "nsqlookupd_tcp_addresses": [],
    "auth_http_addresses": [],
    "auth_http_request_method": "get",
    "http_client_connect_timeout": 2.0,
    "http_client_request_timeout": 5.0,
    "data_path": "",
    "mem_queue_size": 10000,
    "max_bytes_per_file": 100 * 1024 * 1024,
    "sync_every": 2500,
    "sync_timeout": 2.0,
    "queue_scan_interval": 0.1,
    "queue_scan_refresh_interval": 5.0,
    "queue_scan_selection_count": 20,
    "queue_scan_worker_pool_max": 4,
    "queue_scan_dirty_percent": 0.25,
    "msg_timeout": 60.0,
    "max_msg_timeout": 900.0,
    "max_msg_size": 1048576,
    "max_body_size": 5242880,
    "max_req_timeout": 3600.0,
    "client_timeout": 60.0,
    "max_heartbeat_interval": 60.0,
    "max_rdy_count": 2500,
    "max_output_buffer_size": 65536,
    "max_output_buffer_timeout": 30.0,
    "min_output_buffer_timeout": 0.025,
    "output_buffer_timeout": 0.25,
    "max_channel_consumers": 0,
    "statsd_address": "",
    "statsd_prefix": "nsq.%s",
    "statsd_interval": 60.0,
    "statsd_mem_stats": True,
    "statsd_udp_packet_size": 508,
    "e2e_processing_latency_window_time": 600.0,
    "e2e_processing_latency_percentiles": [],
    "tls_cert": "",
    "tls_key": "",
    "tls_client_auth_policy": "",
    "tls_root_ca_file": "",
    "tls_required": "false",
    "deflate": True,
    "max_deflate_level": 6,
    "snappy": True,
}


@pytest.mark.parametrize("name, expected", sorted(NSQD_DEFAULTS.items()))
def test_defaults_are_nsqds(name, expected):
    assert getattr(parse_options([]), name) == expected


def test_host_derived_defaults_are_nsqds():
    o = parse_options([])
    assert o.node_id == _go_default_node_id()
    assert 0 <= o.node_id < 1024
    assert o.broadcast_address == socket.gethostname()
    assert o.heartbeat_interval == 30.0  # ClientTimeout / 2


def test_default_https_address_is_nsqds():
    """nsqd.NewOptions sets HTTPSAddress "0.0.0.0:4152", so a Go nsqd given --tls-cert/--tls-key serves
    HTTPS on 4152 without any --https-address; here the default is "" and no HTTPS listener starts."""
    assert parse_options([]).https_address == "0.0.0.0:4152"


def test_defaults_are_fresh_lists_per_instance():
    a, b = parse_options([]), parse_options([])
    a.nsqlookupd_tcp_addresses.append("x:4160")
    assert b.nsqlookupd_tcp_addresses == [] and Options().nsqlookupd_tcp_addresses == []


# --- flags ------------------------------------------------------------------------------------------


def test_flags_use_nsqds_names_and_units():
    o = parse_options([
        "--node-id=42", "--tcp-address=127.0.0.1:0", "--http-address", "127.0.0.1:0",
        "--lookupd-tcp-address=a:4160", "--lookupd-tcp-address=b:4160", "--mem-queue-size=0",
        "--msg-timeout=1m30s", "--max-req-timeout=2h", "--sync-timeout=250ms", "--max-msg-size=10",
        "--snappy=false", "--deflate=false", "--tls-required", "--statsd-mem-stats=false",
        "--auth-http-address=auth:4181", "--e2e-processing-latency-percentile=0.99",
        "--e2e-processing-latency-percentile=0.5",
    ])
    assert o.node_id == 42 and o.tcp_address == "127.0.0.1:0" and o.http_address == "127.0.0.1:0"
    assert o.nsqlookupd_tcp_addresses == ["a:4160", "b:4160"]
    assert (o.mem_queue_size, o.msg_timeout, o.max_req_timeout, o.sync_timeout, o.max_msg_size) == (0, 90.0, 7200.0, 0.25, 10)
    assert (o.snappy, o.deflate, o.tls_required, o.statsd_mem_stats) == (False, False, "true", False)
    assert o.auth_http_addresses == ["auth:4181"]
    assert o.e2e_processing_latency_percentiles == [0.99, 0.5]


@pytest.mark.parametrize("argv", [["--mem-queue-size=lots"], ["--msg-timeout=soon"], ["--snappy=maybe"], ["--no-such-flag"]])
def test_bad_flags_exit(argv):
    with pytest.raises(SystemExit):
        parse_options(argv)


def test_e2e_percentiles_flag_takes_a_comma_separated_list_as_nsqd():
    """nsqd's help: 'can be specified multiple times or comma separated '1.0,0.99,0.95''
    (app.FloatArray.Set splits on ','); here the comma form is refused."""
    o = parse_options(["--e2e-processing-latency-percentile=1.0,0.99,0.95"])
    assert sorted(o.e2e_processing_latency_percentiles) == [0.95, 0.99, 1.0]


# --- --config TOML ----------------------------------------------------------------------------------


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "nsqd.cfg"
    path.write_text(text, encoding="utf-8")
    return f"--config={path}"


CONFIG = """
id = 7
log_level = "debug"
tcp_address = "127.0.0.1:5150"
http_address = "127.0.0.1:5151"
nsqlookupd_tcp_addresses = ["10.0.0.1:4160", "10.0.0.2:4160"]
mem_queue_size = 5
msg_timeout = "30s"
max_msg_timeout = "5m"
sync_every = 10
sync_timeout = "500ms"
max_msg_size = 2048
max_rdy_count = 100
snappy = false
tls_required = false
e2e_processing_latency_percentiles = [1.0, 0.99, 0.95]
statsd_prefix = "nsq.%s.x"
"""


def test_config_overrides_defaults(tmp_path):
    o = parse_options([_config(tmp_path, CONFIG)])
    assert o.node_id == 7 and o.log_level == "debug"
    assert (o.tcp_address, o.http_address) == ("127.0.0.1:5150", "127.0.0.1:5151")
    assert o.nsqlookupd_tcp_addresses == ["10.0.0.1:4160", "10.0.0.2:4160"]
    assert (o.mem_queue_size, o.msg_timeout, o.max_msg_timeout, o.sync_every, o.sync_timeout) == (5, 30.0, 300.0, 10, 0.5)
    assert (o.max_msg_size, o.max_rdy_count, o.snappy, o.tls_required) == (2048, 100, False, "false")
    assert o.e2e_processing_latency_percentiles == [1.0, 0.99, 0.95]
    assert o.statsd_prefix == "nsq.%s.x"
    # what the file does not name keeps nsqd's default
    assert (o.max_body_size, o.deflate, o.max_req_timeout) == (5242880, True, 3600.0)


def test_flags_override_config(tmp_path):
    o = parse_options([
        _config(tmp_path, CONFIG), "--node-id=9", "--mem-queue-size=0", "--msg-timeout=2m",
        "--lookupd-tcp-address=127.0.0.1:4160", "--snappy",
    ])
    assert (o.node_id, o.mem_queue_size, o.msg_timeout, o.snappy) == (9, 0, 120.0, True)
    assert o.nsqlookupd_tcp_addresses == ["127.0.0.1:4160"]  # the flag replaces the file's list
    assert o.sync_every == 10  # untouched by flags: still the file's


def test_flag_order_relative_to_config_does_not_matter(tmp_path):
    cfg = _config(tmp_path, CONFIG)
    assert parse_options(["--mem-queue-size=1", cfg]).mem_queue_size == 1
    assert parse_options([cfg, "--mem-queue-size=1"]).mem_queue_size == 1


def test_config_single_string_for_a_list_key(tmp_path):
    o = parse_options([_config(tmp_path, 'nsqlookupd_tcp_addresses = "10.0.0.1:4160"\n')])
    assert o.nsqlookupd_tcp_addresses == ["10.0.0.1:4160"]


def test_node_id_key_is_id_as_in_nsqd(tmp_path):
    assert parse_options([_config(tmp_path, "id = 1023\n")]).node_id == 1023
    # nsqd's cfg tag is "id": node_id is no key, so it is ignored like any other unknown key
    assert parse_options([_config(tmp_path, "node_id = 3\n")]).node_id == _go_default_node_id()


@pytest.mark.parametrize("text", ["no_such_key = 1\n", "lookupd_tcp_address = [\"a:1\"]\n", "[section]\nx = 1\n"])
def test_unknown_config_keys_are_ignored_as_go_options_does(tmp_path, text):
    # go-options.Resolve only looks up the keys of known options; nsqd neither fails nor warns
    o = parse_options([_config(tmp_path, "mem_queue_size = 3\n" + text)])
    assert o.mem_queue_size == 3 and o.nsqlookupd_tcp_addresses == []


@pytest.mark.parametrize("text", ['mem_queue_size = "lots"\n', 'msg_timeout = "soon"\n', 'snappy = "maybe"\n'])
def test_bad_config_value_exits(tmp_path, text):
    with pytest.raises(SystemExit):
        parse_options([_config(tmp_path, text)])


# contrib/nsqd.cfg.example from nsqio/nsq, comments dropped
NSQD_CFG_EXAMPLE = """
log_level = "info"
tcp_address = "0.0.0.0:4150"
http_address = "0.0.0.0:4151"
nsqlookupd_tcp_addresses = [
    "127.0.0.1:4160"
]
http_client_connect_timeout = "2s"
http_client_request_timeout = "5s"
mem_queue_size = 10000
max_bytes_per_file = 104857600
sync_every = 2500
sync_timeout = "2s"
msg_timeout = "60s"
max_msg_timeout = "15m"
max_msg_size = 1024768
max_req_timeout = "1h"
max_body_size = 5123840
max_heartbeat_interval = "60s"
max_rdy_count = 2500
max_output_buffer_size = 65536
max_output_buffer_timeout = "1s"
statsd_prefix = "nsq.%s"
statsd_interval = "60s"
statsd_mem_stats = true
e2e_processing_latency_percentiles = [
    1.0,
    0.99,
    0.95
]
e2e_processing_latency_window_time = "10m"
tls_cert = ""
tls_key = ""
tls_required = false
tls_min_version = ""
deflate = true
max_deflate_level = 6
snappy = true
"""


def test_nsqds_own_example_config_loads(tmp_path):
    o = parse_options([_config(tmp_path, NSQD_CFG_EXAMPLE)])
    assert o.nsqlookupd_tcp_addresses == ["127.0.0.1:4160"]
    assert (o.max_msg_timeout, o.max_msg_size, o.max_body_size, o.max_output_buffer_timeout) == (900.0, 1024768, 5123840, 1.0)
    assert o.e2e_processing_latency_window_time == 600.0
    assert o.e2e_processing_latency_percentiles == [1.0, 0.99, 0.95]


# every key Go nsqd resolves from a config file (go-options: the cfg tag, else the flag with '_')
NSQD_CONFIG_KEYS = {
    "id": 1, "log_level": "info", "log_prefix": "[nsqd] ", "tcp_address": "0.0.0.0:4150",
    "http_address": "0.0.0.0:4151", "https_address": "0.0.0.0:4152", "broadcast_address": "h",
    "broadcast_tcp_port": 0, "broadcast_http_port": 0, "nsqlookupd_tcp_addresses": ["a:4160"],
    "auth_http_addresses": ["a:4181"], "auth_http_request_method": "get",
    "http_client_connect_timeout": "2s", "http_client_request_timeout": "5s",
    "topology_region": "r", "topology_zone": "z",
    "data_path": "", "mem_queue_size": 1, "max_bytes_per_file": 1024, "sync_every": 1, "sync_timeout": "2s",
    "queue_scan_selection_count": 20, "queue_scan_worker_pool_max": 4,
    "msg_timeout": "60s", "max_msg_timeout": "15m", "max_msg_size": 1, "max_body_size": 1, "max_req_timeout": "1h",
    "max_heartbeat_interval": "60s", "max_rdy_count": 1, "max_output_buffer_size": 1,
    "max_output_buffer_timeout": "1s", "min_output_buffer_timeout": "25ms", "output_buffer_timeout": "250ms",
    "max_channel_consumers": 0,
    "statsd_address": "", "statsd_prefix": "nsq.%s", "statsd_interval": "60s", "statsd_mem_stats": True,
    "statsd_udp_packet_size": 508, "statsd_exclude_ephemeral": True,
    "e2e_processing_latency_window_time": "10m", "e2e_processing_latency_percentiles": [0.99],
    "tls_cert": "", "tls_key": "", "tls_client_auth_policy": "", "tls_root_ca_file": "",
    "tls_required": False, "tls_min_version": "tls1.2",
    "deflate": True, "max_deflate_level": 6, "snappy": True,
    "enable_experiment": ["topology-aware-consumption"],
}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def test_every_nsqd_config_key_loads(tmp_path):
    """A config file written for Go nsqd must load, whatever nsqd key it sets."""
    refused = []
    for key, value in NSQD_CONFIG_KEYS.items():
        try:
            parse_options([_config(tmp_path, f"{key} = {_toml_value(value)}\n")])
        except SystemExit:
            refused.append(key)
    assert refused == []


def test_every_nsqd_flag_is_accepted():
    """A command line written for Go nsqd must parse (apps/nsqd/options.go nsqdFlagSet)."""
    refused = []
    for key, value in NSQD_CONFIG_KEYS.items():
        flag = {
            "id": "node-id", "nsqlookupd_tcp_addresses": "lookupd-tcp-address",
            "auth_http_addresses": "auth-http-address",
            "e2e_processing_latency_percentiles": "e2e-processing-latency-percentile",
        }.get(key, key.replace("_", "-"))
        if isinstance(value, list):
            value = value[0]
        arg = f"--{flag}={str(value).lower() if isinstance(value, bool) else value}"
        try:
            parse_options([arg])
        except SystemExit:
            refused.append(arg)
    assert refused == []


@pytest.mark.parametrize(
    "key, toml_int, seconds",
    [("msg_timeout", 60000, 60.0), ("sync_timeout", 2000, 2.0), ("output_buffer_timeout", 250, 0.25)],
)
def test_config_integer_duration_is_milliseconds_as_in_nsqd(tmp_path, key, toml_int, seconds):
    """go-options coerceDuration: an integer TOML value for a time.Duration is taken as milliseconds
    ("treat like ms"), so `msg_timeout = 60000` is 60 s in Go nsqd."""
    o = parse_options([_config(tmp_path, f"{key} = {toml_int}\n")])
    assert math.isclose(getattr(o, key), seconds)


def test_options_fields_carry_help_for_every_flag():
    for field in attrs.fields(Options):
        assert field.metadata.get("help"), field.name


# --- Go's flag syntax ---------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["-mem-queue-size=5"], ["-mem-queue-size", "5"], ["--mem-queue-size=5"], ["--mem-queue-size", "5"],
])
def test_every_form_of_go_flag_syntax(argv):
    assert parse_options(argv).mem_queue_size == 5


def test_booleans_as_go_takes_them():
    assert parse_options(["-snappy=false"]).snappy is False
    assert parse_options(["-snappy=0", "-deflate=F"]).deflate is False
    assert parse_options(["-snappy=false", "-snappy"]).snappy is True
    # a boolean never takes the next argument: "false" is the first non-flag, where parsing stops
    o = parse_options(["-snappy", "false", "-mem-queue-size=5"])
    assert o.snappy is True and o.mem_queue_size == 10000


def test_parsing_stops_at_the_first_non_flag_or_double_dash():
    assert parse_options(["-mem-queue-size=1", "extra", "-mem-queue-size=2"]).mem_queue_size == 1
    assert parse_options(["-mem-queue-size=1", "--", "-mem-queue-size=2"]).mem_queue_size == 1


def test_a_value_may_start_with_a_dash_and_the_last_flag_wins():
    assert parse_options(["-log-prefix", "-x-", "-node-id=1", "-node-id=2"]).log_prefix == "-x-"
    assert parse_options(["-node-id=1", "-node-id=2"]).node_id == 2


def test_tls_required_takes_nsqds_values():
    for given, value in (([], "false"), (["-tls-required"], "true"), (["-tls-required=true"], "true"),
                         (["-tls-required=false"], "false"), (["-tls-required=tcp-https"], "tcp-https"),
                         (["-tls-required=TCP-HTTPS"], "tcp-https")):
        assert parse_options(given).tls_required == value, given


def test_deprecated_flags_are_accepted_and_reported():
    from trio_nsq.broker.options import parse_command_line

    options, used = parse_command_line(["-verbose", "--worker-id=true", "-mem-queue-size=3"])
    assert used == ["verbose", "worker-id"] and options.mem_queue_size == 3


def test_nsqds_start_checks():
    for argv, message in ((["-node-id=1024"], "--node-id must be [0,1024)"),
                          (["-max-deflate-level=0"], "--max-deflate-level must be [1,9]"),
                          (["-e2e-processing-latency-percentile=0"], "invalid E2E processing latency percentile: 0")):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_options(argv).check()
    parse_options(["-node-id=1023", "-max-deflate-level=9", "-e2e-processing-latency-percentile=1.0"]).check()


# --- merged from test_unit_core.py -----------------------------------------------------------


@pytest.mark.parametrize("text, seconds", [("1m30s", 90), ("250ms", 0.25), ("2h", 7200), ("1.5s", 1.5), ("10", 10)])
def test_parse_duration_common_forms(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "10x", "1m-"])
def test_parse_duration_refuses(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_defaults_of_the_main_limits_are_nsqds():
    o = parse_options([])
    assert (o.mem_queue_size, o.msg_timeout, o.max_msg_size, o.max_body_size, o.max_rdy_count) == (
        10000, 60.0, 1048576, 5242880, 2500)
    assert (o.max_req_timeout, o.max_msg_timeout, o.sync_every, o.sync_timeout) == (3600.0, 900.0, 2500, 2.0)
    assert (o.tcp_address, o.http_address, o.output_buffer_timeout) == ("0.0.0.0:4150", "0.0.0.0:4151", 0.25)


def test_flags_win_over_config_which_wins_over_defaults(tmp_path):
    cfg = tmp_path / "nsqd.toml"
    cfg.write_text('id = 7\nmem_queue_size = 5\nmsg_timeout = "30s"\nnsqlookupd_tcp_addresses = ["a:4160", "b:4160"]\n')
    o = parse_options([f"--config={cfg}", "--mem-queue-size=9"])
    assert (o.node_id, o.mem_queue_size, o.msg_timeout, o.nsqlookupd_tcp_addresses) == (7, 9, 30.0, ["a:4160", "b:4160"])


def test_config_file_reads_like_go_options(tmp_path):
    cfg = tmp_path / "nsqd.toml"
    # an integer duration is milliseconds, and a key of no option is ignored, as go-options does
    cfg.write_text("msg_timeout = 30000\nno_such_key = 1\n")
    assert parse_options([f"--config={cfg}"]).msg_timeout == 30.0


def test_max_defer_time_caps_dpub_apart_from_max_req_timeout(tmp_path):
    """Not in nsqd (DPUB is capped by --max-req-timeout there): 0, the default, means nsqd's cap; days
    are allowed; the config file takes it as every duration (a string, or an integer of milliseconds)."""
    o = parse_options([])
    assert (o.max_defer_time, o.max_defer) == (0.0, 3600.0)
    assert parse_options(["--max-req-timeout=2h"]).max_defer == 7200.0
    o = parse_options(["--max-defer-time=168h"])
    assert (o.max_defer_time, o.max_defer, o.max_req_timeout) == (604800.0, 604800.0, 3600.0)
    assert parse_options([_config(tmp_path, 'max_defer_time = "72h"\n')]).max_defer == 259200.0
    assert parse_options([_config(tmp_path, "max_defer_time = 90000\n")]).max_defer == 90.0
    with pytest.raises(ValueError, match=re.escape("--max-defer-time must be >= 0")):
        parse_options(["--max-defer-time=-1s"]).check()
