"""``kvfabric doctor``: each check passes on a sound setup and names what a planted fault broke."""

from __future__ import annotations

import json
import subprocess
import sys

from kvfabric import doctor
from kvfabric.doctor import Outcome
from kvfabric.ucm_layer.hashing import Fingerprint

FP = Fingerprint("smollm2", "float32", "FullAttentionSpec:3x64", 32, 1)


def _write(path, fp: Fingerprint) -> str:
    path.write_text(json.dumps(fp.to_mapping()))
    return str(path)


def test_a_planted_fingerprint_mismatch_is_named_with_both_values(tmp_path):
    a = _write(tmp_path / "a.json", FP)
    b = tmp_path / "engine-b.log"  # the connector's start-up line, as it appears in a log
    other = Fingerprint(FP.model, "bfloat16", FP.kv_layout, FP.block_size, FP.tp_size)
    b.write_text(
        "INFO kvfabric.connector: other line\n"
        f"INFO kvfabric.connector: kvfabric: {doctor.FINGERPRINT_MARK} {other.digest().hex()[:16]} "
        f"{json.dumps(other.to_mapping(), sort_keys=True)}\n"
    )
    f = doctor.check_fingerprints([a, str(b)])
    assert f.outcome is Outcome.FAILED
    assert "kv_dtype: 'float32'" in f.detail and "'bfloat16'" in f.detail and "model" not in f.detail
    same = doctor.check_fingerprints([a, _write(tmp_path / "c.json", FP)])
    assert same.outcome is Outcome.OK and FP.digest().hex()[:16] in same.detail
    assert doctor.check_fingerprints([a]).outcome is Outcome.SKIPPED
    (tmp_path / "junk.txt").write_text("no fingerprint here\n")
    bad = doctor.check_fingerprints([a, str(tmp_path / "junk.txt")])
    assert bad.outcome is Outcome.FAILED and "junk.txt" in bad.detail


def test_hashing_agrees_across_processes_and_a_difference_is_caught(monkeypatch):
    assert doctor.check_hashing(("3",)).outcome is Outcome.OK
    monkeypatch.setattr(doctor, "reference_ids", lambda: "00" * 16)  # this process hashes differently
    f = doctor.check_hashing(("3",))
    assert f.outcome is Outcome.FAILED and "PYTHONHASHSEED=3" in f.detail


def test_store_round_trip_and_an_unwritable_store(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(f"store: posix\nposix_path: {tmp_path / 'kv'}\n")
    f = doctor.check_store(str(good))
    assert f.outcome is Outcome.OK and f.detail.startswith("posix:"), f.detail
    (tmp_path / "file").write_text("not a directory")
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"store: posix\nposix_path: {tmp_path / 'file' / 'kv'}\n")
    f = doctor.check_store(str(bad))
    assert f.outcome is Outcome.FAILED and f.detail.startswith("posix:"), f.detail
    assert doctor.check_store(None).outcome is Outcome.SKIPPED


def test_command_exits_1_on_a_failed_check(tmp_path):
    a = _write(tmp_path / "a.json", FP)
    b = _write(tmp_path / "b.json", Fingerprint(FP.model, FP.kv_dtype, FP.kv_layout, 16, FP.tp_size))
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "doctor", "--fingerprint", a, "--fingerprint", b, "--json"],
        capture_output=True,
        text=True,
    )
    rows = {r["check"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert out.returncode == 1 and rows["fingerprint"]["outcome"] == "failed"
    assert "block_size: 32" in rows["fingerprint"]["detail"] and rows["hashing"]["outcome"] == "ok"
