"""Checkpoint manifests: SHA-256s of every file, signed with the job's secret when it has one, so
a process without the secret can neither corrupt a checkpoint nor plant one unnoticed (the
engines' end-to-end cases: tests/engines/test_fsdp2.py, tests/engines/test_deepspeed.py)."""

import hashlib
import json

import pytest

from dist_sr.engines.checkpoints import MANIFEST, CheckpointCorrupt, manifest_key, verify_manifest, write_manifest
from dist_sr.secret import SecretMissing

KEY, OTHER = b"k" * 32, b"o" * 32


@pytest.fixture
def no_secrets(monkeypatch):
    for name in (
        "DIST_SR_CHECKPOINT_SECRET",
        "DIST_SR_CHECKPOINT_SECRET_FILE",
        "DIST_SR_SYNC_SECRET",
        "DIST_SR_SYNC_SECRET_FILE",
    ):
        monkeypatch.delenv(name, raising=False)


def _checkpoint(directory, key):
    (directory / "shards").mkdir(parents=True)
    (directory / "shards" / "0.distcp").write_bytes(b"\x00\x01" * 1000)
    (directory / ".metadata").write_bytes(b"metadata")
    write_manifest(directory, key)
    return directory


def _unsigned_manifest(directory):
    """What a writer without the secret can make: SHA-256s that match the files it wrote."""
    files = {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    (directory / MANIFEST).write_text(json.dumps({"sha256": files}))


def test_a_signed_manifest_verifies_with_its_key_only(tmp_path):
    d = _checkpoint(tmp_path / "step3", KEY)
    assert "hmac_sha256" in json.loads((d / MANIFEST).read_text())
    verify_manifest(d, KEY)
    with pytest.raises(CheckpointCorrupt, match="signature does not match this job's secret"):
        verify_manifest(d, OTHER)


def test_files_planted_with_matching_unsigned_hashes_are_refused(tmp_path):
    d = _checkpoint(tmp_path / "step3", KEY)
    (d / ".metadata").write_bytes(b"planted")
    _unsigned_manifest(d)
    with pytest.raises(CheckpointCorrupt, match="not signed, but this job signs its checkpoints"):
        verify_manifest(d, KEY)


def test_an_old_signature_over_new_hashes_or_a_changed_file_is_refused(tmp_path):
    d = _checkpoint(tmp_path / "a", KEY)
    manifest = json.loads((d / MANIFEST).read_text())
    manifest["sha256"][".metadata"] = hashlib.sha256(b"planted").hexdigest()
    (d / ".metadata").write_bytes(b"planted")
    (d / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorrupt, match="signature does not match"):
        verify_manifest(d, KEY)
    d = _checkpoint(tmp_path / "b", KEY)
    (d / "shards" / "0.distcp").write_bytes(b"\x00\x02" * 1000)
    with pytest.raises(CheckpointCorrupt, match=r"files differ from those written: \['shards/0.distcp'\]"):
        verify_manifest(d, KEY)


def test_without_a_secret_manifests_are_unsigned_and_a_signed_one_asks_for_its_key(tmp_path, no_secrets):
    assert manifest_key() is None
    d = _checkpoint(tmp_path / "a", None)
    assert "hmac_sha256" not in json.loads((d / MANIFEST).read_text())
    verify_manifest(d)
    (d / ".metadata").write_bytes(b"flipped")  # corruption is still caught
    with pytest.raises(CheckpointCorrupt, match="files differ"):
        verify_manifest(d)
    signed = _checkpoint(tmp_path / "b", KEY)
    with pytest.raises(
        CheckpointCorrupt, match="signed, but this process has no key to check it: set DIST_SR_CHECKPOINT_SECRET"
    ):
        verify_manifest(signed)


def test_the_key_is_the_checkpoint_secret_else_the_sync_secret(tmp_path, no_secrets, monkeypatch):
    monkeypatch.setenv("DIST_SR_SYNC_SECRET", "s" * 32)
    assert manifest_key() == b"s" * 32
    f = tmp_path / "secret"
    f.write_text("c" * 32 + "\n")
    monkeypatch.setenv("DIST_SR_CHECKPOINT_SECRET_FILE", str(f))
    assert manifest_key() == b"c" * 32
    d = _checkpoint(tmp_path / "step1", None)  # signed with the process's key by default
    verify_manifest(d, b"c" * 32)
    monkeypatch.setenv("DIST_SR_CHECKPOINT_SECRET", "short")
    with pytest.raises(SecretMissing, match="checkpoint secret from DIST_SR_CHECKPOINT_SECRET has 5 bytes"):
        manifest_key()
