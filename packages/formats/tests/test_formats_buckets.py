"""wsync/1 buckets: pack/unpack round trip, greedy planning, the HTTP body, corrupt bytes."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save

from posttrain.formats import (
    DTYPES,
    BucketFormatError,
    bucket_body_manifest,
    decode_bucket_body,
    encode_bucket_body,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)
from posttrain.interface import BUCKET_ALIGNMENT, WIRE_DTYPES, BucketManifest, WireFormatError

MIXED = [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool]
named_tensors = st.lists(
    st.tuples(st.sampled_from(MIXED), st.lists(st.integers(0, 5), max_size=3)),
    min_size=1,
    max_size=6,
)


def _tensors(spec: list[tuple[torch.dtype, list[int]]]) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (f"t{i}", (torch.randn(shape, generator=gen) * 50).to(dt))
        for i, (dt, shape) in enumerate(spec)
    ]


def test_wire_dtypes_are_the_interface_s() -> None:
    assert {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()} == (
        WIRE_DTYPES
    )


@settings(max_examples=40, deadline=None)
@given(spec=named_tensors, align=st.sampled_from([1, 64, BUCKET_ALIGNMENT]))
def test_pack_unpack_round_trip_mixed_dtypes(
    spec: list[tuple[torch.dtype, list[int]]], align: int
) -> None:
    tensors = _tensors(spec)
    manifest, buf = pack_bucket(tensors, update_id="u", weight_version=1, alignment=align)
    assert BucketManifest.from_json(manifest.to_json()) == manifest
    assert all(e.offset % align == 0 for e in manifest.tensors)
    assert manifest.sha256 == hashlib.sha256(buf.numpy().tobytes()).hexdigest()
    for payload in (buf, bytes(buf.numpy()), memoryview(bytearray(buf.numpy()))):
        out = unpack_bucket(manifest, payload)
        assert list(out) == [name for name, _ in tensors]
        for name, t in tensors:
            assert out[name].dtype == t.dtype
            assert torch.equal(out[name], t)
    # Over HTTP: the same tensors, the same manifest.
    manifest2, out = decode_bucket_body(encode_bucket_body(manifest, buf))
    assert manifest2 == manifest
    assert all(torch.equal(out[name], t) for name, t in tensors)


@settings(max_examples=40, deadline=None)
@given(spec=named_tensors, cap=st.integers(1, 400))
def test_plan_is_greedy_in_order_and_respects_the_cap(
    spec: list[tuple[torch.dtype, list[int]]], cap: int
) -> None:
    tensors = _tensors(spec)
    buckets = plan_buckets(tensors, cap)
    assert [item for bucket in buckets for item in bucket] == tensors  # order kept, none lost
    for i, bucket in enumerate(buckets):
        manifest, _ = pack_bucket(bucket, update_id="u", weight_version=1)
        assert manifest.total_bytes <= cap or len(bucket) == 1  # only a lone tensor overflows
        if i + 1 < len(buckets):  # greedy: the next tensor did not fit
            grown, _ = pack_bucket([*bucket, buckets[i + 1][0]], update_id="u", weight_version=1)
            assert grown.total_bytes > cap


def test_sha256_and_bounds_are_checked() -> None:
    manifest, buf = pack_bucket([("a", torch.ones(4))], update_id="u", weight_version=1)
    bad = buf.clone()
    bad[0] ^= 1
    with pytest.raises(BucketFormatError, match="sha256") as e:
        unpack_bucket(manifest, bad)
    assert e.value.field == "manifest.sha256"
    assert isinstance(e.value, WireFormatError)
    with pytest.raises(BucketFormatError, match="total_bytes"):
        unpack_bucket(manifest, buf[:8])


def test_pack_into_a_reused_slot_zeroes_the_gaps() -> None:
    slot = torch.full((4096,), 0xFF, dtype=torch.uint8)
    tensors = [("a", torch.ones(3, dtype=torch.bfloat16)), ("b", torch.ones(2))]
    m1, _ = pack_bucket(tensors, update_id="u", weight_version=1, out=slot)
    m2, _ = pack_bucket(tensors, update_id="u", weight_version=1)
    assert m1.sha256 == m2.sha256
    with pytest.raises(BucketFormatError, match="out: the bucket needs"):
        pack_bucket(tensors, update_id="u", weight_version=1, out=slot[:10])


def test_body_must_match_its_manifest() -> None:
    tensors = [("a", torch.ones(2, dtype=torch.bfloat16)), ("b", torch.ones(3))]
    manifest, buf = pack_bucket(tensors, update_id="u", weight_version=1)
    meta = {"manifest": manifest.to_json()}
    wrong_dtype = st_save({"a": torch.ones(2), "b": torch.ones(3)}, metadata=meta)
    with pytest.raises(BucketFormatError, match="'a' is float32 \\[2\\] in the body"):
        decode_bucket_body(wrong_dtype)
    missing = st_save({"a": torch.ones(2, dtype=torch.bfloat16)}, metadata=meta)
    with pytest.raises(BucketFormatError, match=r"manifest tensors \['b'\] are not in the body"):
        decode_bucket_body(missing)
    with pytest.raises(BucketFormatError, match=r"__metadata__\.manifest: missing"):
        decode_bucket_body(st_save(dict(tensors)))
    tampered = bytearray(encode_bucket_body(manifest, buf))
    tampered[-1] ^= 1  # the last data byte: the body still parses, the digest does not match
    with pytest.raises(BucketFormatError, match="sha256"):
        decode_bucket_body(bytes(tampered))


def test_the_manifest_reads_alone_and_the_sender_does_not_check_the_digest() -> None:
    tensors = [("a", torch.ones(2, dtype=torch.bfloat16)), ("b", torch.ones(3))]
    manifest, buf = pack_bucket(tensors, update_id="u", weight_version=1)
    stale = manifest.model_copy(update={"sha256": "0" * 64})
    body = encode_bucket_body(stale, buf)  # encoding trusts the packer's digest...
    assert bucket_body_manifest(body) == stale  # ...the manifest reads without the tensors...
    with pytest.raises(BucketFormatError, match="sha256"):
        decode_bucket_body(body)  # ...and the receiver checks the bytes it got
    with pytest.raises(BucketFormatError, match="total_bytes"):
        encode_bucket_body(manifest, buf[:8])
    with pytest.raises(BucketFormatError, match=r"__metadata__\.manifest: missing"):
        bucket_body_manifest(st_save(dict(tensors)))


def _named_or_fine(fn: Any, *args: Any) -> None:
    """``fn(*args)`` succeeds or raises a ``BucketFormatError`` naming a field; nothing else."""
    error: BucketFormatError | None = None
    try:
        fn(*args)
    except BucketFormatError as exc:
        error = exc
    assert error is None or error.field, error


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_corrupted_bodies_decode_or_raise_a_named_error(data: st.DataObject, corrupt: Any) -> None:
    tensors = [("w", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(2, dtype=torch.int64))]
    manifest, buf = pack_bucket(tensors, update_id="u", weight_version=3)
    _named_or_fine(decode_bucket_body, corrupt(data, encode_bucket_body(manifest, buf)))


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(
        st.fixed_dictionaries(
            {
                "name": st.sampled_from(["a", "b", "c"]),
                "dtype": st.sampled_from(sorted(WIRE_DTYPES)),
                "shape": st.lists(st.integers(0, 6), max_size=2),
                "offset": st.integers(0, 2048),
            }
        ),
        max_size=3,
    ),
    total=st.integers(0, 4096),
    size=st.integers(0, 4096),
    alignment=st.sampled_from([1, 3, 256]),
    sha=st.none() | st.just("0" * 64),
)
def test_arbitrary_manifests_unpack_or_raise_a_named_error(
    entries: list[dict[str, Any]], total: int, size: int, alignment: int, sha: str | None
) -> None:
    for entry in entries:
        numel = 1
        for dim in entry["shape"]:
            numel *= dim
        entry["nbytes"] = numel * WIRE_DTYPES[entry["dtype"]]
    raw = {
        "update_id": "u",
        "weight_version": 1,
        "kind": "base",
        "bucket_index": 0,
        "is_last": True,
        "alignment": alignment,
        "total_bytes": total,
        "tensors": entries,
        "sha256": sha,
    }
    try:
        manifest = BucketManifest.parse(raw)
    except WireFormatError as exc:  # the interface's manifest validation names the field
        refused: WireFormatError | None = exc
    else:
        refused = None
    if refused is not None:
        assert refused.field, refused
        return
    _named_or_fine(unpack_bucket, manifest, torch.zeros(size, dtype=torch.uint8))
