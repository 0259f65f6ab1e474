"""``bench.peers`` smoke: torch TP and FSDP2 against axo4d on 2 local ranks, one tiny step each;
the first-step losses of both sides must agree (the run fails otherwise); a bad pair is exit 2."""

from __future__ import annotations

import json

import pytest

from bench import peers

TINY = ["--n-embd", "64", "--n-layer", "1", "--n-head", "4", "--seq", "32", "--batch", "4"]


@pytest.mark.timeout(300)
def test_peers_smoke_tp_and_fsdp2(tmp_path, capsys) -> None:
    out = tmp_path / "peers.json"
    argv = ["--local", "--pairs", "x2,z2", *TINY, "--steps", "1", "--rounds", "1", "--warmup", "1", "--json", str(out)]
    assert peers.main(argv) == 0
    res = json.loads(out.read_text())
    assert [r["pair"] for r in res["pairs"]] == ["x2", "z2"]
    for r in res["pairs"]:
        fl = r["first_loss"]
        assert r["losses_agree"] and fl["axo4d"] == pytest.approx(fl["peer"], rel=1e-5), r
        assert r["ratio"] == pytest.approx(r["median_s"]["axo4d"] / r["median_s"]["peer"])
        assert r["denormals"] == "flushed"
    text = capsys.readouterr().out
    assert "fp32 (subnormals flushed)" in text
    assert "| x2 | x=2 |" in text and "| FSDP2 (fully_shard) |" in text and "load average before" in text


def test_peers_bad_pair(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        peers.main(["--pairs", "x3"])
    assert e.value.code == 2
    assert "--pairs x3" in capsys.readouterr().err


def test_subnormals_are_reported_as_the_thread_computes_them() -> None:
    from bench.subnormals import observed, set_subnormals

    before = observed()
    try:
        assert set_subnormals(True) == "flushed" and observed() == "flushed"
        assert set_subnormals(False) == "kept" and observed() == "kept"
    finally:
        set_subnormals(before == "flushed")
