"""Optional: every weight-sync body we send is accepted by SGLang's own request classes, every
route we call is in SGLang's route table, and a full update's names/dtypes/shapes load through
SGLang's own model class.

Runs where ``sglang`` imports: CI runs it in the side environment ``.ci/sglang-conformance``
builds (pinned sglang with ``--no-deps``), where it must pass; the workspace's own suite skips
it. The bodies are validated the way SGLang's HTTP server reads them: FastAPI through the
pydantic schema of each ``io_struct`` class (``TypeAdapter(cls).validate_json``). The route table
is read from ``http_server.py``'s decorators (importing the server needs a GPU stack). The model
check writes tensors of exactly the update's names, dtypes and shapes next to the checkpoint's
``config.json`` and runs ``models``' SGLang probe on it: every SGLang parameter written, no
tensor unused.
"""

from __future__ import annotations

import ast
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

io_struct = pytest.importorskip("sglang.srt.managers.io_struct")
pydantic = pytest.importorskip("pydantic")

from safetensors.torch import save_file  # noqa: E402

from posttrain.formats import (  # noqa: E402
    DestroyWeightsUpdateGroupReq,
    InitWeightsUpdateGroupReq,
    LoadLoraAdapterReq,
    UpdateWeightFromDiskReq,
    UpdateWeightsFromTensorReq,
    UpdateWeightVersionReq,
    adapter_push_body,
    bucket_request,
    dtype_from_name,
    plan_buckets,
)
from posttrain.interface import WireModel  # noqa: E402
from posttrain.models import (  # noqa: E402
    ModelConfig,
    build_model,
    save_pretrained,
    to_hf_state_dict,
)

PROBE = Path(__file__).parents[1] / "packages/models/tests/sglang_load_probe.py"
# Every route the trainer side calls on an engine (grpo's sync, lora-core's client, formats'
# push_distributed, the readmission probe and the memory cycle).
ROUTES_WE_CALL = (
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/update_weights_from_tensor",
    "/update_weights_from_disk",
    "/update_weight_version",
    "/load_lora_adapter",
    "/load_lora_adapter_from_tensors",
    "/unload_lora_adapter",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/model_info",
    "/server_info",
    "/health",
)


def _sglang_accepts(cls: type, body: WireModel | dict[str, Any]) -> Any:
    raw = body.to_json() if isinstance(body, WireModel) else json.dumps(body)
    return pydantic.TypeAdapter(cls).validate_json(raw)


def _full_update() -> tuple[ModelConfig, list[tuple[str, torch.Tensor]]]:
    cfg = ModelConfig.tiny(torch_dtype="bfloat16")
    model = build_model(cfg, seed=0)
    return cfg, list(to_hf_state_dict(dict(model.state_dict()), cfg).items())


def test_every_body_we_send_is_accepted_by_sglangs_classes() -> None:
    _, tensors = _full_update()
    buckets = plan_buckets(tensors, 1 << 16)
    assert len(buckets) > 1
    for k, bucket in enumerate(buckets):
        last = k == len(buckets) - 1
        ours = bucket_request(bucket, last=last, weight_version=7)
        theirs = _sglang_accepts(io_struct.UpdateWeightsFromDistributedReqInput, ours)
        assert theirs.names == [n for n, _ in bucket]
        assert [getattr(torch, d) for d in theirs.dtypes] == [t.dtype for _, t in bucket]
        assert theirs.flush_cache is last
        assert theirs.weight_version == ("7" if last else None)
    init = InitWeightsUpdateGroupReq(
        master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=3,
        backend="nccl",
    )  # fmt: skip
    got = _sglang_accepts(io_struct.InitWeightsUpdateGroupReqInput, init)
    assert (got.rank_offset, got.world_size, got.backend) == (1, 3, "nccl")
    assert got.group_name == "weight_update_group"
    _sglang_accepts(io_struct.DestroyWeightsUpdateGroupReqInput, DestroyWeightsUpdateGroupReq())
    disk = UpdateWeightFromDiskReq(model_path="/ckpt", weight_version="3")
    assert _sglang_accepts(io_struct.UpdateWeightFromDiskReqInput, disk).weight_version == "3"
    version = UpdateWeightVersionReq(new_version="4")
    assert _sglang_accepts(io_struct.UpdateWeightVersionReqInput, version).new_version == "4"
    tensor = UpdateWeightsFromTensorReq(serialized_named_tensors=[b"rank0", b"rank1"])
    got = _sglang_accepts(io_struct.UpdateWeightsFromTensorReqInput, tensor)
    assert got.serialized_named_tensors == [b"rank0", b"rank1"]
    path = LoadLoraAdapterReq(lora_name="policy", lora_path="/adapters/policy")
    _sglang_accepts(io_struct.LoadLoRAAdapterReqInput, path)
    lora = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 8)}
    body = adapter_push_body(
        "policy", {"r": 2, "target_modules": ["q_proj"]}, lora, tp_size=2,
        expected_checksums={"x": "00"},
    )  # fmt: skip
    got = _sglang_accepts(io_struct.LoadLoRAAdapterFromTensorsReqInput, body)
    assert len(got.serialized_named_tensors) == 2  # one copy per TP rank
    # SGLang's own deserializer (its safe unpickler) reads our payload as the tensors we sent
    from sglang.srt.utils.common import MultiprocessingSerializer

    read = MultiprocessingSerializer.deserialize(got.serialized_named_tensors[0])
    assert set(read) == set(lora)
    assert all(torch.equal(read[k], v) for k, v in lora.items())


def test_colocated_tensor_updates_read_back_through_sglangs_deserializer() -> None:
    """``weight_sync=tensor``: the bodies validate as ``UpdateWeightsFromTensorReqInput``, and
    SGLang's ``MultiprocessingSerializer`` (its safe unpickler) reads each bucket back, here on
    CPU tensors (shared-memory handles where a GPU's are CUDA IPC ones): flattened buckets
    through its ``FlattenedTensorBucket``, plain ones as ``(name, tensor)`` pairs, to exactly
    the names and values we sent, every dtype at its alignment."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from posttrain.formats import FLATTENED_BUCKET, tensor_update_requests

    _, tensors = _full_update()
    tensors += [("odd.bytes", torch.arange(7, dtype=torch.uint8)),
                ("fp8.scale", torch.full((3,), 0.5).to(torch.float8_e4m3fn))]  # fmt: skip
    sent = dict(tensors)
    for flattened in (True, False):
        requests, held = tensor_update_requests(
            tensors, weight_version=9, tp_size=2, flattened=flattened, bucket_bytes=1 << 16
        )
        assert len(requests) > 1
        read: dict[str, torch.Tensor] = {}
        for k, ours in enumerate(requests):
            got = _sglang_accepts(io_struct.UpdateWeightsFromTensorReqInput, ours)
            last = k == len(requests) - 1
            assert (got.flush_cache, got.weight_version) == (last, "9" if last else None)
            assert got.load_format == (FLATTENED_BUCKET if flattened else None)
            assert len(got.serialized_named_tensors) == 2  # one per TP rank
            payload = MultiprocessingSerializer.deserialize(got.serialized_named_tensors[1])
            if flattened:
                bucket = FlattenedTensorBucket(
                    flattened_tensor=payload["flattened_tensor"], metadata=payload["metadata"]
                )
                pairs = bucket.reconstruct_tensors()
            else:
                pairs = payload
            for name, t in pairs:
                assert name not in read
                read[name] = t.clone()
        del held
        assert list(read) == list(sent)
        for name, t in sent.items():
            assert (read[name].dtype, read[name].shape) == (t.dtype, t.shape), name
            assert torch.equal(read[name].view(torch.uint8), t.view(torch.uint8)), name


def test_flattened_distributed_buckets_are_what_sglangs_receiver_allocates() -> None:
    """``update_weights_from_distributed`` with ``load_format="flattened_bucket"`` (the
    default push): each body validates, and SGLang's own receive buffer
    (``FlattenedTensorBucket.empty`` from the body's names, dtypes and shapes), filled with the
    bytes we broadcast, reconstructs exactly the tensors we sent (every dtype: BF16 weights,
    NVFP4's uint8 codes, fp8 scales and fp32 global scales, an odd byte count)."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from posttrain.formats import FLATTENED_BUCKET, flat_bytes, flat_order

    _, tensors = _full_update()
    tensors += [("odd.bytes", torch.arange(7, dtype=torch.uint8)),
                ("fp8.scale", torch.full((3,), 0.5).to(torch.float8_e4m3fn)),
                ("global.scale", torch.tensor([0.25, 2.0]))]  # fmt: skip
    buckets = plan_buckets(tensors, 1 << 16)
    assert len(buckets) > 1
    read: dict[str, torch.Tensor] = {}
    for k, planned in enumerate(buckets):
        bucket = flat_order(planned)
        last = k == len(buckets) - 1
        ours = bucket_request(bucket, last=last, weight_version=5, flattened=True)
        got = _sglang_accepts(io_struct.UpdateWeightsFromDistributedReqInput, ours)
        assert got.load_format == FLATTENED_BUCKET
        receiver = FlattenedTensorBucket.empty(got.names, got.dtypes, got.shapes, "cpu")
        flat = receiver.get_flattened_tensor()
        sent = flat_bytes(bucket)
        assert flat.shape == sent.shape
        flat.copy_(sent)  # what the broadcast does
        for name, t in receiver.reconstruct_tensors():
            read[name] = t.clone()
    assert set(read) == {n for n, _ in tensors}
    for name, t in tensors:
        assert (read[name].dtype, read[name].shape) == (t.dtype, t.shape), name
        assert torch.equal(read[name].view(torch.uint8), t.view(torch.uint8)), name


def test_the_old_wsync_bodies_are_refused_by_sglang() -> None:
    """The negative control: what the trainer sent before (issue 32) does not parse."""
    with pytest.raises(pydantic.ValidationError):
        _sglang_accepts(
            io_struct.LoadLoRAAdapterFromTensorsReqInput,
            {"lora_name": "p", "config_dict": {}, "serialized_tensors": "eA=="},
        )


def test_every_route_we_call_is_in_sglangs_route_table() -> None:
    server = Path(io_struct.__file__).parents[1] / "entrypoints" / "http_server.py"
    routes: set[str] = set()
    for node in ast.walk(ast.parse(server.read_text())):
        if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            for dec in node.decorator_list:
                if (
                    isinstance(dec, ast.Call)
                    and isinstance(dec.func, ast.Attribute)
                    and dec.func.attr in {"get", "post", "api_route", "put"}
                    and dec.args
                    and isinstance(dec.args[0], ast.Constant)
                ):
                    routes.add(str(dec.args[0].value))
    assert "/generate" in routes  # the table was read
    missing = [r for r in ROUTES_WE_CALL if r not in routes]
    assert missing == []
    for gone in ("/update_weights_from_shm", "/update_weights_from_safetensors"):
        assert gone not in routes


def _received(update: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What SGLang's receiver holds after each bucket: tensors it allocated from the request's
    names/dtypes/shapes, filled with the broadcast values."""
    received: dict[str, torch.Tensor] = {}
    for bucket in plan_buckets(update, 1 << 16):
        req = bucket_request(bucket, last=False, weight_version=1)
        for (name, t), dtype, shape in zip(bucket, req.dtypes, req.shapes, strict=True):
            received[name] = torch.empty(shape, dtype=dtype_from_name(dtype)).copy_(t)
    return received


def _probe(script: Path, ckpt: Path) -> dict[str, Any]:
    """Run an SGLang probe script on ``ckpt`` in a child process; its ``PROBE`` result."""
    done = subprocess.run(
        [sys.executable, str(script), str(_free_port()), str(ckpt)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("PROBE "))
    payload = line.removeprefix("PROBE ")
    if not payload.startswith("{"):  # the models probe names the directory first
        payload = payload.partition(" ")[2]
    result: dict[str, Any] = json.loads(payload)
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_full_update_loads_through_sglangs_model_class(tmp_path: Path) -> None:
    cfg, tensors = _full_update()
    ckpt = tmp_path / "update"
    save_pretrained(build_model(cfg, seed=0), ckpt)  # config.json (and a checkpoint, replaced)
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    save_file(_received(tensors), str(ckpt / "model.safetensors"))
    result = _probe(PROBE, ckpt)
    assert result["unwritten"] == []
    assert result["unused"] == []
    assert result["fused_ok"], result["fused_bad"]


NVFP4_PROBE = Path(__file__).with_name("sglang_nvfp4_probe.py")


def test_an_nvfp4_update_loads_through_sglangs_modelopt_fp4_model(tmp_path: Path) -> None:
    """The engines start from quant-convert's checkpoint; grpo's sync quantizes each update
    with the same selection (``quantize_named_params``) and sends the packed tensors: SGLang's
    own model class with its ``ModelOptFp4Config`` takes every one into a parameter of the
    right shape, and every parameter a checkpoint load writes gets written, ``input_scale``
    included (the served checkpoint's values, read back as grpo's fleet reads them)."""
    from posttrain.quant_convert import (
        ConvertOptions,
        QuantPolicy,
        convert_checkpoint,
        quantize_named_params,
        read_input_scales,
    )

    cfg = ModelConfig.tiny(torch_dtype="bfloat16", mlp_only_layers=())
    model = build_model(cfg, seed=0)
    save_pretrained(model, tmp_path / "bf16")
    ckpt = tmp_path / "nvfp4"
    convert_checkpoint(tmp_path / "bf16", ckpt, options=ConvertOptions(policy=QuantPolicy()))
    trained = build_model(cfg, seed=1)  # the weights after some steps
    hf = to_hf_state_dict(dict(trained.state_dict()), cfg)
    update = quantize_named_params(
        hf.items(), num_layers=cfg.num_hidden_layers, policy=QuantPolicy(),
        input_scales=read_input_scales(ckpt),
    )  # what grpo's sync sends for rollout_quant=nvfp4  # fmt: skip
    names = {n for n, _ in update}
    assert any(n.endswith(".weight_scale_2") for n in names)
    assert any(n.endswith(".input_scale") for n in names)
    save_file(_received(update), str(ckpt / "update.safetensors"))
    result = _probe(NVFP4_PROBE, ckpt)
    assert result["mismatched"] == []
    assert result["unused"] == []
    assert result["unwritten"] == []
