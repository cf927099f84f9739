"""Retention policy strings: parsing, canonical names, block rounding, and refusals."""

import pytest
from kvcore.errors import InvalidArgumentError
from kvcore.retention.spec import (
    RetentionError,
    RetentionPolicy,
    parse_retention,
    parse_retention_list,
)


def test_parse_each_kind():
    assert parse_retention("full") == RetentionPolicy("full")
    assert parse_retention(None) == RetentionPolicy("full")
    assert parse_retention("window:1024") == RetentionPolicy("window", window=1024)
    assert parse_retention("sink:4+window:1020") == RetentionPolicy("sink", sink=4, window=1020)
    p = parse_retention("h2o:budget=1024+sink=8+window=256")
    assert (p.kind, p.budget, p.sink, p.window) == ("h2o", 1024, 8, 256)
    d = parse_retention("h2o:budget=1024")  # defaults: 4 sinks, half the budget recent
    assert (d.sink, d.window, d.budget) == (4, 512, 1024)
    assert not parse_retention("full").lossy and d.lossy


def test_names_round_trip_and_metric_names():
    for s in ["full", "window:7", "sink:4+window:1020", "h2o:budget=100+sink=4+window=20"]:
        p = parse_retention(s)
        assert parse_retention(p.name) == p
    assert parse_retention("sink:4+window:1020").metric_name == "sink_4_window_1020"
    assert parse_retention("h2o:budget=1024").metric_name == "h2o_budget_1024"


def test_list_order_and_duplicates():
    ps = parse_retention_list("full,sink:4+window:1020,window:1024,h2o:budget=1024")
    assert [p.kind for p in ps] == ["full", "sink", "window", "h2o"]
    with pytest.raises(RetentionError, match="twice"):
        parse_retention_list("window:8,window:8")


def test_blocks_round_up():
    b = parse_retention("sink:4+window:1020").blocks(16)
    assert (b.sink, b.window, b.budget, b.heavy) == (1, 64, 0, 0)
    h = parse_retention("h2o:budget=1024+sink=4+window=512").blocks(16)
    assert (h.sink, h.window, h.budget, h.heavy) == (1, 32, 64, 31)
    assert parse_retention("full").blocks(16).budget == 0
    with pytest.raises(RetentionError, match="below sinks plus window"):
        parse_retention("h2o:budget=24+sink=4+window=17").blocks(16)  # 2 < 1 + 2 blocks
    with pytest.raises(RetentionError):
        parse_retention("full").blocks(0)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "nope",
        "window",
        "window:",
        "window:-4",
        "window:0",
        "window:x",
        "full:3",
        "full+window:3",
        "sink:4",
        "sink:4+window:0",
        "sink:4+budget:9",
        "sink:4+window:8+window:8",
        "h2o",
        "h2o:budget",
        "h2o:budget=0",
        "h2o:budget=10+sink=8+window=8",
        "h2o:budget=64+heavy=3",
        "h2o:budget=64+budget=3",
        "window:1.5",
        7,
    ],
)
def test_bad_specs_raise_typed_errors(bad):
    with pytest.raises(InvalidArgumentError):
        parse_retention(bad)
