"""Run a plan: stream every shard to NVFP4, atomically and resumably; then write the metadata.

Memory stays near the largest gate/up pair plus its outputs: tensors are read one at a time
(pairs back to back), quantized in row chunks, and appended to a writer whose header was laid
out from the plan; pass-through tensors are copied in 8 MiB pieces and never held whole. On a
GPU the three steps overlap (``pipeline``): a reader thread, the quantizing thread and a
writer thread pass at most two items each through bounded queues, so a conversion runs at
the disk's speed rather than the sum of read, quantize and write times.
Each shard appears under its final name only when complete (``*.tmp``, fsync, rename) and is
then recorded in ``.quant-convert/state.json`` with its sha256 and the plan fingerprint (a
hash of the input headers, sizes, mtimes and options). A resume skips recorded shards whose
files still hash the same, and refuses a state written for other inputs or options unless
``overwrite``. The metadata (index, configs, copied files, manifest) is written last, so an
interrupted run never looks complete. Departures from miles: the source is read once (not
twice to find pairs), a cross-shard partner is read again only for its amax, dst equal to or
nested in src is refused, and other files are copied with their subdirectories.

Failures are named, never raw: an OS error on the destination (read-only, full disk) is an
``OutputError`` and leaves no ``*.tmp`` behind (the shards recorded so far stay valid, so
rerunning the same command resumes); an unreadable state file is a ``ResumeError``; any
unreadable source (config, index, header) a ``CheckpointError``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.formats import AtomicFile, NVFP4QuantConfig, nvfp4_config_sections
from posttrain.interface import ConfigError
from posttrain.quant_convert._errors import CheckpointError, ResumeError
from posttrain.quant_convert.nvfp4 import global_amax, quantize_nvfp4
from posttrain.quant_convert.plan import ConvertOptions, Plan, ShardPlan, plan_conversion
from posttrain.quant_convert.safetensors_io import (
    ByteCounter,
    SafetensorsReader,
    ShardWriter,
    output_error,
    read_json_object,
    write_bytes_atomic,
)

__all__ = ["ConversionReport", "ProgressEvent", "convert_checkpoint"]

STATE_DIR = ".quant-convert"
MANIFEST = "quant_convert_manifest.json"
_HASH_CHUNK = 16 << 20


@dataclass(slots=True, frozen=True)
class ProgressEvent:
    """Sent to a progress callback after each tensor and at each shard's end."""

    shard: str
    bytes_done: int  # source bytes of finished tensors, all shards
    bytes_total: int
    shard_done: bool


@dataclass(slots=True, frozen=True)
class ConversionReport:
    plan: Plan
    dst: Path
    tensors_quantized: int
    tensors_kept: int
    exclusion_entries: tuple[str, ...]
    bytes_in: int  # bytes actually read from the source
    bytes_out: int
    shards_written: tuple[str, ...]
    shards_resumed: tuple[str, ...]
    seconds: float
    dry_run: bool


ProgressCallback = Callable[[ProgressEvent], None]
_PIPELINE_DEPTH = 2  # items in flight between reader -> quantizer -> writer


@dataclass(slots=True, frozen=True)
class _Piece:
    """Part of a kept tensor's bytes."""

    name: str
    data: bytes | bytearray
    final: bool
    source_bytes: int


@dataclass(slots=True, frozen=True)
class _Weight:
    """A weight to quantize with its global amax."""

    source: str
    tensor: torch.Tensor
    amax: torch.Tensor
    source_bytes: int


@dataclass(slots=True, frozen=True)
class _Quantized:
    """The tensors that replace a weight, on the CPU, in layout order."""

    tensors: list[tuple[str, torch.Tensor]]
    source_bytes: int


_Item = _Piece | _Weight
_END = object()


class _StoppedError(Exception):
    """Another pipeline stage failed; this one stops quietly."""


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise: after the first large
    free it raises its mmap threshold, so later multi-MiB buffers come from a heap it never
    shrinks, and RSS creeps up by tens of MiB per shard). No-op off glibc."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None


def _check_paths(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if s == d:
        raise CheckpointError(f"save dir {dst} is the model dir; refusing to overwrite inputs")
    if s in d.parents or d in s.parents:
        raise CheckpointError(f"save dir {dst} and model dir {src} are nested; use sibling dirs")


def _sha256_file(path: Path) -> str | None:
    """The file's sha256; None when it cannot be read (a resume then redoes that shard)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


class _Run:
    def __init__(
        self,
        plan: Plan,
        dst: Path,
        device: torch.device,
        progress: ProgressCallback | None,
        pipeline: bool = False,
    ):
        self.plan = plan
        self.dst = dst
        self.device = device
        self.pipeline = pipeline
        self.progress = progress
        self.counter = ByteCounter()
        self._amax_lock = threading.Lock()
        self._amax: dict[str, float | list[float]] = {}
        self._done_lock = threading.Lock()
        self.bytes_done = 0

    def _tick(self, shard: str, n: int, done: bool = False) -> None:
        with self._done_lock:
            self.bytes_done += n
            event = ProgressEvent(shard, self.bytes_done, self.plan.source_bytes, done)
        if self.progress is not None:
            self.progress(event)

    def has_amax(self, name: str) -> bool:
        with self._amax_lock:
            return name in self._amax

    def amax_of(self, name: str, loaded: torch.Tensor | None) -> torch.Tensor:
        # memoised as Python floats (exact for fp32): thousands of tiny tensors kept alive
        # between multi-MiB transients fragment glibc's heap, and RSS then grows with the shard
        with self._amax_lock:
            if name in self._amax:
                return torch.tensor(self._amax[name], dtype=torch.float32)
        if loaded is None:  # a partner in another shard: read it for its amax only
            with SafetensorsReader(self.plan.src / self.plan.tensor_file[name], self.counter) as r:
                loaded = r.read_tensor(name)
        a = global_amax(loaded, per_expert=loaded.dim() == 3).to("cpu")
        with self._amax_lock:
            self._amax[name] = a.tolist()
        return a

    def _items(self, shard: ShardPlan, reader: SafetensorsReader) -> Iterator[_Item]:
        """What the shard's writer gets, in layout order: pieces of kept tensors (the last one
        ``final`` and carrying the tensor's source bytes), and weights to quantize, each with
        its (pair-shared) global amax."""
        held: dict[str, torch.Tensor] = {}
        for out in shard.outputs:
            if out.kind == "copy":
                for piece in reader.iter_bytes(out.source):
                    yield _Piece(out.name, piece, final=False, source_bytes=0)
                yield _Piece(
                    out.name, b"", final=True, source_bytes=reader.entries[out.source].nbytes
                )
                continue
            if out.kind != "weight":
                continue  # scales are written together with their weight
            w = held.pop(out.source, None)
            if w is None:
                w = reader.read_tensor(out.source)
            amax = self.amax_of(out.source, w)
            partner = self.plan.partners.get(out.source)
            if partner is not None:
                if (
                    partner in reader.entries and partner not in held and not self.has_amax(partner)
                ):  # the partner comes next in this shard: read it once, now
                    held[partner] = reader.read_tensor(partner)
                amax = torch.maximum(amax, self.amax_of(partner, held.get(partner)))
            yield _Weight(out.source, w, amax, reader.entries[out.source].nbytes)

    def _quantize(self, item: _Weight) -> list[tuple[str, torch.Tensor]]:
        opts = self.plan.options
        q = quantize_nvfp4(
            item.tensor.to(self.device),
            global_amax=item.amax.to(self.device),
            cfg=opts.quant,
            name=item.source,
            allow_3d=opts.policy.quantize_3d_experts,
        )
        return [(n, t.cpu()) for n, t in q.named(item.source, input_scale=opts.input_scale)]

    def _write(self, writer: ShardWriter, shard: str, item: _Piece | _Quantized) -> None:
        if isinstance(item, _Piece):
            writer.write(item.name, item.data, final=item.final)
            if item.final:
                self._tick(shard, item.source_bytes)
            return
        for name, t in item.tensors:
            writer.write_tensor(name, t)
        self._tick(shard, item.source_bytes)

    def convert_shard(self, shard: ShardPlan) -> str:
        layout = [(o.name, o.dtype, o.shape) for o in shard.outputs]
        writer = ShardWriter(self.dst / shard.file, layout, {"format": "pt"})
        try:
            with SafetensorsReader(self.plan.src / shard.file, self.counter) as reader:
                if self.pipeline:
                    self._convert_pipelined(shard, reader, writer)
                else:
                    for item in self._items(shard, reader):
                        if isinstance(item, _Weight):
                            done = _Quantized(self._quantize(item), item.source_bytes)
                            del item
                            self._write(writer, shard.file, done)
                        else:
                            self._write(writer, shard.file, item)
            sha = writer.finish()
            _release_freed_memory()  # per shard: per tensor it costs more in page faults
        except BaseException:
            writer.abort()
            raise
        return sha

    def _convert_pipelined(
        self, shard: ShardPlan, reader: SafetensorsReader, writer: ShardWriter
    ) -> None:
        """Read, quantize and write overlapped: a reader thread and a writer thread around
        this one (which quantizes), joined by queues of ``_PIPELINE_DEPTH`` items, so memory
        stays bounded while the disk and the device work at once. The first error stops all
        three and is raised here."""
        failed = threading.Event()
        errors: list[BaseException] = []
        read_q: queue.Queue[Any] = queue.Queue(_PIPELINE_DEPTH)
        write_q: queue.Queue[Any] = queue.Queue(_PIPELINE_DEPTH)

        def put(q: queue.Queue[Any], item: Any) -> None:
            while not failed.is_set():
                try:
                    q.put(item, timeout=0.05)
                    return
                except queue.Full:
                    continue
            raise _StoppedError

        def get(q: queue.Queue[Any]) -> Any:
            while not failed.is_set():
                try:
                    return q.get(timeout=0.05)
                except queue.Empty:
                    continue
            raise _StoppedError

        def guarded(fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                try:
                    fn()
                except _StoppedError:
                    pass
                except BaseException as exc:
                    errors.append(exc)
                    failed.set()

            return run

        def read_all() -> None:
            for item in self._items(shard, reader):
                put(read_q, item)
            put(read_q, _END)

        def write_all() -> None:
            while (item := get(write_q)) is not _END:
                self._write(writer, shard.file, item)

        def quantize_all() -> None:
            while (item := get(read_q)) is not _END:
                if isinstance(item, _Weight):
                    item = _Quantized(self._quantize(item), item.source_bytes)
                put(write_q, item)
            put(write_q, _END)

        threads = [
            threading.Thread(target=guarded(read_all), name=f"read {shard.file}", daemon=True),
            threading.Thread(target=guarded(write_all), name=f"write {shard.file}", daemon=True),
        ]
        for t in threads:
            t.start()
        try:
            guarded(quantize_all)()
        finally:
            for t in threads:
                t.join()
        if errors:
            raise errors[0]


def _load_state(dst: Path) -> dict[str, Any] | None:
    for p in (dst / STATE_DIR / "state.json", dst / MANIFEST):
        if p.is_file():
            data = read_json_object(p, ResumeError)
            if not isinstance(data.get("shards", {}), dict):
                raise ResumeError(f"{p}: 'shards' is not an object; pass --overwrite")
            return data
    return None


def _make_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise output_error(exc, path, "create") from exc


def _write_state(dst: Path, fingerprint: str, done: dict[str, str]) -> None:
    _make_dir(dst / STATE_DIR)
    blob = json.dumps({"fingerprint": fingerprint, "shards": done}, indent=1, sort_keys=True)
    write_bytes_atomic(dst / STATE_DIR / "state.json", blob.encode())


def _resumable(
    plan: Plan, dst: Path, resume: bool, overwrite: bool, verify: bool
) -> dict[str, str]:
    """Shards already done (name -> sha256) that this run may keep."""
    if not dst.exists() or overwrite:
        return {}
    state = _load_state(dst)
    if state is None:
        try:
            stray = [p.name for p in dst.iterdir()]
        except OSError as exc:
            raise output_error(exc, dst, "list") from exc
        if stray:
            raise CheckpointError(
                f"save dir {dst} is not empty and holds no conversion state ({stray[0]}, ...); "
                "pass overwrite=True (--overwrite) to write into it anyway"
            )
        return {}
    if not resume:
        raise ResumeError(
            f"{dst} holds an earlier conversion; --no-resume needs --overwrite to start over"
        )
    if state.get("fingerprint") != plan.fingerprint:
        raise ResumeError(
            f"{dst} was written for other inputs or options (fingerprint "
            f"{str(state.get('fingerprint'))[:12]} != {plan.fingerprint[:12]}); pass --overwrite"
        )
    done: dict[str, str] = {}
    for name, sha in dict(state.get("shards", {})).items():
        path = dst / name
        if path.is_file() and (not verify or _sha256_file(path) == sha):
            done[name] = sha
    return done


def _write_metadata(plan: Plan, dst: Path, shas: dict[str, str]) -> int:
    weight_map = {o.name: s.file for s in plan.shards for o in s.outputs}
    total = plan.output_bytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_bytes_atomic(dst / "model.safetensors.index.json", json.dumps(index, indent=2).encode())
    src_hq = plan.src / "hf_quant_config.json"
    section, hq = nvfp4_config_sections(
        NVFP4QuantConfig(
            exclude_modules=tuple(plan.exclusions.entries),
            kv_cache_quant_algo=plan.options.kv_cache_quant_algo,
        ),
        config_section=plan.config.get("quantization_config") or {},
        hf_quant_config=read_json_object(src_hq, CheckpointError) if src_hq.is_file() else None,
    )
    config = dict(plan.config)
    config["quantization_config"] = section
    write_bytes_atomic(dst / "config.json", json.dumps(config, indent=2).encode())
    write_bytes_atomic(dst / "hf_quant_config.json", json.dumps(hq, indent=2).encode())
    for rel in plan.other_files:
        target = dst / rel
        _make_dir(target.parent)
        tmp = target.with_name(target.name + ".tmp")
        try:
            with open(plan.src / rel, "rb") as src_file, AtomicFile(target, tmp=tmp) as out:
                shutil.copyfileobj(src_file, out.file)
        except OSError as exc:  # AtomicFile removed its temp file
            if exc.filename is not None and Path(exc.filename) == plan.src / rel:
                raise CheckpointError(f"{plan.src / rel}: cannot read ({exc.strerror})") from exc
            raise output_error(exc, target, "copy to") from exc
    from posttrain.quant_convert import __version__

    manifest = {
        "producer": "posttrain-quant-convert",
        "version": __version__,
        "fingerprint": plan.fingerprint,
        "options": plan.options.to_json(),
        "inputs": plan.fingerprints,
        "shards": dict(sorted(shas.items())),
        "tensors_quantized": len(plan.quantized),
        "exclusion_entries": len(plan.exclusions.entries),
    }
    write_bytes_atomic(dst / MANIFEST, json.dumps(manifest, indent=2).encode())
    return total


def _device(device: str | int) -> torch.device:
    dev = torch.device(
        f"cuda:{int(device)}" if isinstance(device, int) or str(device).isdigit() else device
    )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}: this torch has no CUDA device")
    return dev


def _convert_shards(
    plan: Plan,
    dst: Path,
    dev: torch.device,
    done: dict[str, str],
    workers: int,
    progress: ProgressCallback | None,
    pipeline: bool,
) -> tuple[list[ShardPlan], int, int]:
    """Convert the shards not in ``done`` (updated in place); (converted, bytes in, bytes out)."""
    try:
        (dst / MANIFEST).unlink(missing_ok=True)  # incomplete until the manifest is back
    except OSError as exc:
        raise output_error(exc, dst / MANIFEST, "remove") from exc
    _write_state(dst, plan.fingerprint, done)
    run = _Run(plan, dst, dev, progress, pipeline)
    todo = [s for s in plan.shards if s.file not in done]
    for s in plan.shards:
        if s.file in done:
            run._tick(s.file, s.source_bytes, done=True)
    lock = threading.Lock()

    def one(shard: ShardPlan) -> None:
        sha = run.convert_shard(shard)
        with lock:
            done[shard.file] = sha
            _write_state(dst, plan.fingerprint, done)
        run._tick(shard.file, 0, done=True)  # after the state records it

    if workers <= 1:
        for s in todo:
            one(s)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for fut in [pool.submit(one, s) for s in todo]:
                fut.result()
    total = _write_metadata(plan, dst, done)
    shutil.rmtree(dst / STATE_DIR, ignore_errors=True)
    return todo, run.counter.total, total


def convert_checkpoint(
    src: Path | str,
    dst: Path | str,
    *,
    options: ConvertOptions | None = None,
    resume: bool = True,
    overwrite: bool = False,
    workers: int = 1,
    device: str | int = "cpu",
    progress: ProgressCallback | None = None,
    verify: bool = True,
    dry_run: bool = False,
    pipeline: bool | None = None,
) -> ConversionReport:
    """Convert HF checkpoint ``src`` into NVFP4 checkpoint ``dst`` (see the module docstring).

    ``verify`` re-hashes shards a resume would keep; ``dry_run`` plans and writes nothing.
    ``pipeline`` overlaps reading, quantizing and writing within a shard (a reader and a
    writer thread around the quantizer, bounded queues); default: on for a GPU ``device``,
    off on the CPU (where quantizing dominates and the sequential path holds less memory).
    The bytes written are the same either way.
    """
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    _check_paths(src, dst)
    dev = _device(device)
    plan = plan_conversion(src, options)
    kept = len(plan.tensor_file) - len(plan.quantized)
    if dry_run:
        return ConversionReport(plan, dst, len(plan.quantized), kept, plan.exclusions.entries,
                                0, 0, (), (), time.perf_counter() - t0, True)  # fmt: skip
    done = _resumable(plan, dst, resume, overwrite, verify)
    created = not dst.exists()
    _make_dir(dst)
    try:
        overlap = dev.type != "cpu" if pipeline is None else pipeline
        todo, counter, total = _convert_shards(plan, dst, dev, done, workers, progress, overlap)
    except BaseException:
        if not done:  # no shard finished: leave nothing that looks like a conversion began
            shutil.rmtree(dst / STATE_DIR, ignore_errors=True)
            if created:
                shutil.rmtree(dst, ignore_errors=True)
        raise
    return ConversionReport(
        plan=plan,
        dst=dst,
        tensors_quantized=len(plan.quantized),
        tensors_kept=kept,
        exclusion_entries=plan.exclusions.entries,
        bytes_in=counter,
        bytes_out=total,
        shards_written=tuple(s.file for s in todo),
        shards_resumed=tuple(s.file for s in plan.shards if s.file not in {t.file for t in todo}),
        seconds=time.perf_counter() - t0,
        dry_run=False,
    )
