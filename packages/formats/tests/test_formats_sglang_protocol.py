"""SGLang's weight-update protocol in formats: bodies, buckets, named tensors, the update group
(two real processes over gloo) and the engine client's errors."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch

from posttrain.formats import (
    FLATTENED_BUCKET,
    BucketFormatError,
    EngineClient,
    LoadLoraAdapterFromTensorsReq,
    NamedTensorsError,
    UpdateWeightsFromDistributedReq,
    adapter_push_body,
    bucket_request,
    decode_adapter_payload,
    deserialize_named_tensors,
    dtype_from_name,
    flat_bytes,
    flat_order,
    free_port,
    plan_buckets,
    serialize_named_tensors,
    unflatten,
)
from posttrain.interface import EngineError, StaleVersionError, WireFormatError


def test_named_tensors_round_trip_by_value_and_anything_else_is_refused() -> None:
    tensors = {
        "a": torch.randn(3, 4).to(torch.bfloat16),
        "b": torch.arange(6, dtype=torch.int64)[1:4],  # a view: travels as its own values
        "c": torch.ones(2, dtype=torch.float16),
    }
    back = deserialize_named_tensors(serialize_named_tensors(tensors))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype
        assert torch.equal(back[k].view(torch.uint8), v.contiguous().view(torch.uint8))
    with pytest.raises(NamedTensorsError, match=r"builtins\.print"):
        deserialize_named_tensors(pickle.dumps(print))
    with pytest.raises(NamedTensorsError, match=r"os\.system"):
        deserialize_named_tensors(b"cos\nsystem\n(S'true'\ntR.")
    with pytest.raises(NamedTensorsError, match="not a named tensor"):
        deserialize_named_tensors(pickle.dumps({"a": [1, 2]}))
    with pytest.raises(NamedTensorsError, match="unreadable"):
        deserialize_named_tensors(serialize_named_tensors(tensors)[:40])


def test_adapter_body_is_one_copy_per_rank_and_copies_must_agree() -> None:
    tensors = {"x.lora_A.weight": torch.ones(2, 4)}
    body = adapter_push_body("p", {"r": 2}, tensors, tp_size=3)
    req = LoadLoraAdapterFromTensorsReq.from_json(body.to_json())
    assert len(req.serialized_named_tensors) == 3
    assert torch.equal(decode_adapter_payload(req).tensors["x.lora_A.weight"], tensors[
        "x.lora_A.weight"])  # fmt: skip
    req.serialized_named_tensors = [req.serialized_named_tensors[0], b"other"]
    with pytest.raises(WireFormatError, match=r"serialized_named_tensors\[1\]"):
        decode_adapter_payload(req)
    with pytest.raises(WireFormatError, match="serialized_named_tensors"):
        LoadLoraAdapterFromTensorsReq.parse(
            {"lora_name": "p", "config_dict": {}, "serialized_named_tensors": ["not base64!"]}
        )


def test_buckets_and_their_requests() -> None:
    ts = [(f"t{i}", torch.zeros(10, dtype=torch.float32)) for i in range(5)]  # 40 bytes each
    assert [len(b) for b in plan_buckets(ts, 100)] == [2, 2, 1]
    assert [len(b) for b in plan_buckets(ts, 10)] == [1] * 5  # larger than the cap: alone
    with pytest.raises(BucketFormatError, match="bucket_bytes"):
        plan_buckets(ts, 0)
    req = bucket_request(ts[:2], last=True, weight_version=9)
    assert (req.names, req.dtypes, req.shapes) == (["t0", "t1"], ["float32"] * 2, [[10], [10]])
    assert (req.flush_cache, req.weight_version) == (True, "9")
    assert bucket_request(ts[:1], last=False, weight_version=9).weight_version is None
    with pytest.raises(WireFormatError, match="differ in length"):
        UpdateWeightsFromDistributedReq.parse({"names": ["a"], "dtypes": [], "shapes": [[1]]})
    with pytest.raises(WireFormatError, match="bogus"):
        UpdateWeightsFromDistributedReq.parse({"names": [], "dtypes": [], "shapes": [], "bogus": 1})


def test_flattened_buckets_pack_wider_items_first_and_unflatten_to_the_same_bytes() -> None:
    """SGLang's flattened distributed bucket: bytes end to end, no padding, each tensor at a
    multiple of its item size (wider items first makes that so); the receiving end's views
    hold the same bytes; a misaligned order and a wrong-sized buffer are refused by name."""
    g = torch.Generator().manual_seed(0)
    bucket = [
        ("codes", torch.randint(0, 255, (3, 5), generator=g, dtype=torch.uint8)),  # 15 bytes
        ("norm", torch.randn(7, generator=g).bfloat16()),  # 14 bytes
        ("scale", torch.randn(3, generator=g).to(torch.float8_e4m3fn)),
        ("w", torch.randn(2, 3, generator=g)),  # fp32
        ("ids", torch.arange(3, dtype=torch.int64)),
    ]
    ordered = flat_order(bucket)
    assert [n for n, _ in ordered] == ["ids", "w", "norm", "codes", "scale"]  # stable
    flat = flat_bytes(ordered)
    assert flat.dtype == torch.uint8
    assert flat.numel() == sum(t.numel() * t.element_size() for _, t in bucket)
    req = bucket_request(ordered, last=True, weight_version=2, flattened=True)
    assert req.load_format == FLATTENED_BUCKET
    dtypes = [dtype_from_name(d) for d in req.dtypes]
    got_flat = flat.clone()
    views = unflatten(req.names, dtypes, req.shapes, got_flat)
    assert list(views) == req.names
    for name, t in bucket:
        assert views[name].dtype == t.dtype
        assert views[name].shape == t.shape
        assert torch.equal(views[name].view(torch.uint8), t.view(torch.uint8))
        assert views[name].data_ptr() >= got_flat.data_ptr()  # views of the one buffer
    with pytest.raises(BucketFormatError, match=r"^norm: starts at byte 15 .*bfloat16 item size 2"):
        flat_bytes(bucket)  # the given order: 15 bytes of codes put norm off its grid
    with pytest.raises(BucketFormatError, match=r"flattened bucket: 3 torch.uint8 elements"):
        unflatten(req.names, dtypes, req.shapes, torch.zeros(3, dtype=torch.uint8))
    assert bucket_request(ordered, last=True, weight_version=2).load_format is None


def test_engine_client_names_engine_route_and_message() -> None:
    def reply(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/stale":
            return httpx.Response(409, json={"error": {"message": "version 3 <= 4"}})
        if request.url.path == "/soft":
            return httpx.Response(200, json={"success": False, "message": "group not joined"})
        return httpx.Response(400, json={"success": False, "message": "Failed to update"})

    with EngineClient("http://e:1", transport=httpx.MockTransport(reply)) as client:
        with pytest.raises(EngineError, match=r"http://e:1 POST /x: HTTP 400: Failed to update"):
            client.post("/x", {})
        with pytest.raises(EngineError, match="/soft: HTTP 200: group not joined"):
            client.post("/soft", {})
        with pytest.raises(StaleVersionError, match="version 3 <= 4"):
            client.post("/stale", {})

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    with EngineClient("http://e:1", transport=httpx.MockTransport(down)) as client:
        with pytest.raises(EngineError) as err:
            client.get("/health")
        assert isinstance(err.value.__cause__, httpx.ConnectError)


MEMBER = textwrap.dedent(
    """
    import sys, torch
    from posttrain.formats import join_update_group
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    g = join_update_group(master_address="127.0.0.1", master_port=port, rank=rank,
                          world_size=3, group_name="weight_update_group", backend="gloo",
                          timeout_s=60)
    torch.manual_seed(0)
    sent = [torch.randn(4, 5).to(torch.bfloat16), torch.randn(3).to(torch.float8_e4m3fn),
            torch.arange(7, dtype=torch.uint8)]
    bufs = sent if rank == 0 else [torch.empty_like(t) for t in sent]
    g.broadcast(bufs)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(bufs, sent))
    print("SAME" if same else "DIFF", flush=True)
    g.destroy()
    """
)


def test_update_group_broadcasts_every_dtype_over_gloo() -> None:
    port = free_port("127.0.0.1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MEMBER, str(r), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
        assert out.strip() == "SAME"


def test_tensor_update_buckets_are_flattened_aligned_and_end_the_update() -> None:
    """``weight_sync=tensor``'s bodies: per bucket one uint8 tensor whose slices view back as
    the tensors sent (each start 16-byte aligned), one payload per TP rank, the last bucket
    carrying ``flush_cache`` and the version. (SGLang's own reader is the conformance test's.)"""
    from posttrain.formats import (
        FLATTENED_BUCKET,
        flatten_bucket,
        serialize_for_engine,
        tensor_update_requests,
    )

    named = [
        ("a", torch.arange(5, dtype=torch.uint8)),
        ("b", torch.randn(3, 2).to(torch.bfloat16)),
        ("c", torch.randn(7, dtype=torch.float64)),
        ("d", torch.full((2,), 0.25).to(torch.float8_e4m3fn)),
    ]
    flat = flatten_bucket(named)
    assert flat["flattened_tensor"].dtype == torch.uint8
    for (name, t), meta in zip(named, flat["metadata"], strict=True):
        assert (meta.name, meta.dtype, meta.shape) == (name, t.dtype, t.shape)
        assert meta.start_idx % 16 == 0
        assert meta.end_idx - meta.start_idx == meta.numel == t.numel() * t.element_size()
        back = flat["flattened_tensor"][meta.start_idx : meta.end_idx].view(t.dtype)
        assert torch.equal(back.reshape(t.shape).view(torch.uint8), t.view(torch.uint8))
    requests, held = tensor_update_requests(named, weight_version=4, tp_size=3, bucket_bytes=64)
    assert len(requests) == len(held) > 1
    assert [r.flush_cache for r in requests] == [False] * (len(requests) - 1) + [True]
    assert [r.weight_version for r in requests][-1] == "4"
    assert {r.load_format for r in requests} == {FLATTENED_BUCKET}
    assert all(len(r.serialized_named_tensors) == 3 for r in requests)
    plain, _ = tensor_update_requests(named, weight_version=None, flattened=False)
    assert plain[0].load_format is None
    assert plain[0].weight_version is None
    assert serialize_for_engine([]) == serialize_for_engine([])
    with pytest.raises(ValueError, match="tp_size"):
        tensor_update_requests(named, weight_version=1, tp_size=0)
