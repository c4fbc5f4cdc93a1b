"""Per-turn latency added by sgl-router and by the session server, and router start-to-ready.

B1: one interleaved run. Each round sends a prompt of ``--sizes`` tokens (512 and 8192) to, in
turn: the worker directly (``/generate``), through sgl-router (``/generate`` with a routing key),
and through the session server then sgl-router as

* a first chat turn of a fresh session with a prompt never seen before (*cold*: the whole prompt
  is rendered and tokenized; each call prefixes a new number to the message),
* a first turn whose prompt an earlier session already sent (*warm*: what every GRPO group member
  after the first is; the tokenization comes from the session server's cache),
* a second turn of such a session (only the appended message is tokenized),
* the session server's raw proxy (its HTTP hop without TITO work),

and a warm first turn through the session server straight to the worker. With ``--floor``,
``floor_proxy.py`` (uvicorn forwarding bytes over a raw connection, no logic) is one more path
in front of the router: the cost of any Python hop in the same run. Every server is its own
process on 127.0.0.1 (the worker is a loopback SGLang-shaped worker returning 16 tokens, Nagle
off). Medians over ``--rounds``. Tokenizing the cold prompt in-process is timed separately
(``server_tokenize_ms_per_cold_turn``, from the server's ``/metrics``), since the direct paths
receive ids their client tokenized before timing began.

Equal work (``equal_work_hop_over_router_hop``): the same conversations are also sent as chat text
(``/v1/chat/completions``) to the worker directly and through sgl-router; the worker's chat route
renders and tokenizes them with the model's transformers tokenizer, the two calls SGLang's chat
route makes. That is the turn a user has without the session server, so a session path's added
latency there is (session path - router chat path), compared with the router's hop for chat
(router chat path - worker chat path). A negative value means the session path is faster.

B2: router start-to-ready: ``start_router`` (the wheel's Python API in a child process) versus
``smg launch`` (the wheel's CLI), each until ``/health`` answers 200. Medians over ``--starts``.

    uv run python packages/session-router/benchmarks/bench_session_router.py [--rounds 300] [--floor]
        [--session-allocator {mimalloc,system}]

Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from posttrain.interface.testing import (
    ServerProcess,
    free_port,
    stop_process_group,
    wait_until_ready,
)
from posttrain.session_router import ChatTokenizer, RouterSpec, start_router
from posttrain.session_router.allocator import ALLOCATORS, DEFAULT_ALLOCATOR

CHATML = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dogs", "while", "agents"]
WORDS += ["call", "tools", "and", "read", "results"]

WORKER = """
import sys, time, warnings
warnings.filterwarnings("ignore")
from transformers import AutoTokenizer
from posttrain.session_router import LoopbackWorker
OUT = list(range(100, 115)) + [2]
# An engine's chat route tokenizes the conversation itself. SGLang's does this with the model's
# transformers tokenizer: apply_chat_template(tokenize=False), then encode(add_special_tokens=False)
# (serving_chat.py, _apply_jinja_template). Those two calls are all this worker does: a lower bound
# on the engine's work (no request validation or message copies), so the baseline is not inflated.
TOK = AutoTokenizer.from_pretrained(sys.argv[2])
def generate(body):
    n = len(body["input_ids"])
    return {"text": "x" * 15, "output_ids": OUT, "meta_info": {
        "prompt_tokens": n, "completion_tokens": len(OUT), "finish_reason": {"type": "stop"},
        "output_token_logprobs": [[-0.25, t, None] for t in OUT]}}
def chat(body):
    text = TOK.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
    n = len(TOK.encode(text, add_special_tokens=False))
    return {"id": "chatcmpl-loopback", "object": "chat.completion", "created": 0,
        "model": "loopback", "choices": [{"index": 0, "finish_reason": "stop",
        "message": {"role": "assistant", "content": "x" * 15}}],
        "usage": {"prompt_tokens": n, "completion_tokens": len(OUT),
        "total_tokens": n + len(OUT)}}
LoopbackWorker(generate=generate, chat=chat, port=int(sys.argv[1])).start()
time.sleep(3600)
"""


def build_tokenizer(root: Path) -> Path:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(WORDS)] * 50, trainer=trainer)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"})
    )
    return root


def message_of(tok: ChatTokenizer, n_tokens: int) -> tuple[str, list[int]]:
    """A user message whose rendered first-turn prompt has about ``n_tokens`` tokens."""
    words: list[str] = []
    while True:
        words.extend(WORDS)
        text = " ".join(words)
        ids = tok.encode(
            tok.render([{"role": "user", "content": text}], add_generation_prompt=True)
        )
        if len(ids) >= n_tokens:
            break
    lo, hi = 1, len(words)
    while lo < hi:  # shortest prefix of words reaching n_tokens
        mid = (lo + hi) // 2
        ids = tok.encode(
            tok.render(
                [{"role": "user", "content": " ".join(words[:mid])}], add_generation_prompt=True
            )
        )
        lo, hi = (mid + 1, hi) if len(ids) < n_tokens else (lo, mid)
    text = " ".join(words[:lo])
    return text, tok.encode(
        tok.render([{"role": "user", "content": text}], add_generation_prompt=True)
    )


def session_server(
    upstream: str, tok_dir: Path, extra: list[str] | None = None
) -> tuple[ServerProcess, str]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "posttrain.session_router",
        "--upstream",
        upstream,
        "--tokenizer",
        str(tok_dir),
        "--port",
        str(port),
        *(extra or []),
    ]
    return ServerProcess(
        argv, f"http://127.0.0.1:{port}/health", timeout_s=60
    ).start(), f"http://127.0.0.1:{port}"


def interleaved(paths: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Ten warm-up calls per path, then ``rounds`` rounds that call every path once in turn."""
    for fn in paths.values():
        for _ in range(10):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            samples[name].append(fn())
    return samples


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))] * 1e3


def cpu_seconds(pid: int) -> float:
    """User+system CPU time a process has used so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tokenize_seconds(url: str, client: httpx.Client) -> float:
    """The session server's ``session_router_tokenize_seconds_total`` (its uncached tokenizing)."""
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith("session_router_tokenize_seconds_total "):
            return float(line.split()[1])
    raise RuntimeError("session_router_tokenize_seconds_total missing from /metrics")


def measure_size(
    client: httpx.Client,
    tok: ChatTokenizer,
    n: int,
    rounds: int,
    urls: dict[str, str],
    pids: dict[str, int],
) -> dict[str, Any]:
    """Interleaved rounds over every path for one prompt size; medians and 10th percentiles."""
    text, ids = message_of(tok, n)
    gen = {"input_ids": ids, "sampling_params": {"max_new_tokens": 16}, "return_logprob": True}
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 16}
    proxy_sid = client.post(f"{urls['session_router']}/sessions").json()["session_id"]
    # a second turn's conversation as chat text, with the assistant message a session returns
    probe_sid = client.post(f"{urls['session_router']}/sessions").json()["session_id"]
    first = client.post(
        f"{urls['session_router']}/sessions/{probe_sid}/v1/chat/completions", json=chat
    )
    assert first.status_code == 200, first.text
    follow_chat = {
        "messages": [
            *chat["messages"],
            first.json()["choices"][0]["message"],
            {"role": "user", "content": "and then?"},
        ],
        "max_tokens": 16,
    }
    client.delete(f"{urls['session_router']}/sessions/{probe_sid}")

    def direct(url: str) -> float:
        t = time.perf_counter()
        r = client.post(f"{url}/generate", json=gen, headers={"X-SMG-Routing-Key": "k"})
        dt = time.perf_counter() - t
        assert r.status_code == 200, r.text
        return dt

    def session(url: str) -> float:
        sid = client.post(f"{url}/sessions").json()["session_id"]
        t = time.perf_counter()
        r = client.post(f"{url}/sessions/{sid}/v1/chat/completions", json=chat)
        dt = time.perf_counter() - t
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        client.delete(f"{url}/sessions/{sid}")
        return dt

    fresh = iter(range(10**9))

    def direct_cold(url: str) -> float:
        """Token ids never sent before (a counter in the first three), under a new routing key.

        What the session server's cold first turn sends on: the baseline for its cold hop.
        """
        c = next(fresh)
        body = {**gen, "input_ids": [c % 397, (c // 397) % 397, c % 389, *ids[3:]]}
        t = time.perf_counter()
        r = client.post(f"{url}/generate", json=body, headers={"X-SMG-Routing-Key": f"cold-{c}"})
        dt = time.perf_counter() - t
        assert r.status_code == 200, r.text
        return dt

    def session_cold(url: str) -> float:
        """A first turn with a prompt the server has never seen (a new number in front)."""
        body = {
            "messages": [{"role": "user", "content": f"{next(fresh)} {text}"}],
            "max_tokens": 16,
        }
        sid = client.post(f"{url}/sessions").json()["session_id"]
        t = time.perf_counter()
        r = client.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body)
        dt = time.perf_counter() - t
        assert r.status_code == 200, r.text
        assert abs(r.json()["usage"]["prompt_tokens"] - len(ids)) <= 8
        client.delete(f"{url}/sessions/{sid}")
        return dt

    def chat_cold(url: str) -> float:
        """The cold first turn's conversation sent as chat text (the engine tokenizes it).

        The baseline a user has without the session server: a chat turn through sgl-router to an
        engine that renders and tokenizes it.
        """
        c = next(fresh)
        body = {
            "model": "loopback",
            "messages": [{"role": "user", "content": f"{c} {text}"}],
            "max_tokens": 16,
        }
        t = time.perf_counter()
        r = client.post(
            f"{url}/v1/chat/completions", json=body, headers={"X-SMG-Routing-Key": f"chat-{c}"}
        )
        dt = time.perf_counter() - t
        assert r.status_code == 200, r.text
        assert abs(r.json()["usage"]["prompt_tokens"] - len(ids)) <= 8
        return dt

    def chat_next(url: str) -> float:
        """A second turn's whole conversation sent as chat text (the engine tokenizes all of it)."""
        body = {"model": "loopback", **follow_chat}
        t = time.perf_counter()
        r = client.post(f"{url}/v1/chat/completions", json=body, headers={"X-SMG-Routing-Key": "k"})
        dt = time.perf_counter() - t
        assert r.status_code == 200, r.text
        return dt

    def next_turn(url: str) -> float:
        """The second turn of a session whose first turn carried the long prompt."""
        sid = client.post(f"{url}/sessions").json()["session_id"]
        r = client.post(f"{url}/sessions/{sid}/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        follow = {
            "messages": [
                *chat["messages"],
                r.json()["choices"][0]["message"],
                {"role": "user", "content": "and then?"},
            ],
            "max_tokens": 16,
        }
        assert follow == follow_chat
        t = time.perf_counter()
        r = client.post(f"{url}/sessions/{sid}/v1/chat/completions", json=follow)
        dt = time.perf_counter() - t
        assert r.status_code == 200, r.text
        client.delete(f"{url}/sessions/{sid}")
        return dt

    paths = {
        "worker": lambda: direct(urls["worker"]),
        "router": lambda: direct(urls["router"]),
        "worker_cold": lambda: direct_cold(urls["worker"]),
        "router_cold": lambda: direct_cold(urls["router"]),
        "session_router_cold": lambda: session_cold(urls["session_router"]),
        "session_router": lambda: session(urls["session_router"]),
        "session_worker": lambda: session(urls["session_worker"]),
        "session_router_next_turn": lambda: next_turn(urls["session_router"]),
        # raw proxy (/sessions/{id}/generate): the session server's HTTP hop without TITO work
        "session_proxy_router": lambda: direct(f"{urls['session_router']}/sessions/{proxy_sid}"),
        **({"floor_proxy": lambda: direct(urls["floor"])} if "floor" in urls else {}),
    }
    # Equal work, a second interleaved phase of the same run: the same conversations as chat
    # text, which the worker renders and tokenizes, next to the session paths measured again. Its
    # own phase because tokenizing a long prompt in the worker slows the worker's next requests
    # (allocator and cache state), which would skew the paths above if mixed in with them.
    equal_paths = {
        "worker_chat_cold": lambda: chat_cold(urls["worker"]),
        "router_chat_cold": lambda: chat_cold(urls["router"]),
        "session_router_cold": paths["session_router_cold"],
        "session_router": paths["session_router"],
        "worker_chat_next_turn": lambda: chat_next(urls["worker"]),
        "router_chat_next_turn": lambda: chat_next(urls["router"]),
        "session_router_next_turn": paths["session_router_next_turn"],
    }
    samples = interleaved(paths, rounds)
    equal_samples = interleaved(equal_paths, rounds)
    # CPU per request of the router and of the session server: less sensitive than wall time to
    # other processes competing for the 2 cores (every path runs 100 more times here).
    spent: dict[str, float] = {}
    for name, pid_name in [
        ("router", "router"),
        ("session_router_cold", "session_router"),
        ("session_router", "session_router"),
        ("session_router_next_turn", "session_router"),
        ("session_proxy_router", "session_router"),
    ]:
        before = cpu_seconds(pids[pid_name])
        tok_before = tokenize_seconds(urls["session_router"], client)
        for _ in range(100):
            paths[name]()
        spent[name] = (cpu_seconds(pids[pid_name]) - before) * 10  # ms per call
        if name == "session_router_cold":
            server_tokenize_ms = (
                tokenize_seconds(urls["session_router"], client) - tok_before
            ) * 10
    cpu = {
        "router_per_generate": round(spent["router"], 2),
        # a session path call is POST /sessions + the turn(s) + DELETE
        "session_server_per_cold_first_turn_with_create_delete": round(
            spent["session_router_cold"], 2
        ),
        "session_server_per_first_turn_with_create_delete": round(spent["session_router"], 2),
        "session_server_per_second_turn": round(
            spent["session_router_next_turn"] - spent["session_router"], 2
        ),
        "session_server_per_raw_proxy": round(spent["session_proxy_router"], 2),
    }
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    p10 = {k: _pct(v, 0.1) for k, v in samples.items()}
    router_hop = med["router"] - med["worker"]
    session_hop = med["session_router"] - med["router"]
    # A cold first turn is compared with the router's hop for never-seen ids under a new key.
    router_hop_cold = med["router_cold"] - med["worker_cold"]
    cold_hop = med["session_router_cold"] - med["router_cold"]
    next_hop = med["session_router_next_turn"] - med["router"]
    # Equal work: against the same conversation sent as chat text through the router to an engine
    # that renders and tokenizes it (the turn a user has without the session server).
    eq = {k: statistics.median(v) * 1e3 for k, v in equal_samples.items()}
    router_hop_chat = eq["router_chat_cold"] - eq["worker_chat_cold"]
    router_hop_chat_next = eq["router_chat_next_turn"] - eq["worker_chat_next_turn"]
    equal_work_hops = {
        name: (hop, base)
        for name, hop, base in [
            (
                "first_turn_cold",
                eq["session_router_cold"] - eq["router_chat_cold"],
                router_hop_chat,
            ),
            ("first_turn_warm", eq["session_router"] - eq["router_chat_cold"], router_hop_chat),
            (
                "second_turn",
                eq["session_router_next_turn"] - eq["router_chat_next_turn"],
                router_hop_chat_next,
            ),
        ]
    }
    equal_work = {
        name: round(hop / base, 2) if base > 0 else None
        for name, (hop, base) in equal_work_hops.items()
    }
    proxy_hop = med["session_proxy_router"] - med["router"]
    return {
        "prompt_tokens": len(ids),
        # mean wall time the session server spent tokenizing one cold first turn (its /metrics)
        "server_tokenize_ms_per_cold_turn": round(server_tokenize_ms, 3),
        "median_ms": {k: round(v, 3) for k, v in med.items()},
        "p10_ms": {k: round(v, 3) for k, v in p10.items()},
        "router_hop_ms": round(router_hop, 3),
        "router_hop_cold_ms": round(router_hop_cold, 3),
        "session_hop_ms": round(session_hop, 3),
        "session_cold_hop_ms": round(cold_hop, 3),
        "session_proxy_hop_ms": round(proxy_hop, 3),
        "session_next_turn_hop_ms": round(next_hop, 3),
        "cpu_ms_per_request": cpu,
        # each session hop over the router hop it is compared with (cold turns: the cold one)
        "hop_over_router_hop": {
            name: round(hop / base, 2) if base > 0 else None
            for name, hop, base in [
                ("first_turn_cold", cold_hop, router_hop_cold),
                ("first_turn_cold_less_tokenize", cold_hop - server_tokenize_ms, router_hop_cold),
                ("first_turn_warm", session_hop, router_hop),
                ("second_turn", next_hop, router_hop),
                ("raw_proxy", proxy_hop, router_hop),
                *(
                    [("python_floor_proxy", med["floor_proxy"] - med["router"], router_hop)]
                    if "floor_proxy" in med
                    else []
                ),
            ]
        },
        "equal_work_median_ms": {k: round(v, 3) for k, v in eq.items()},
        "router_hop_chat_ms": round(router_hop_chat, 3),
        "router_hop_chat_next_turn_ms": round(router_hop_chat_next, 3),
        # the session path's added latency over the same turn as chat text through the router
        # (engine tokenizes), over the router's hop for that chat turn
        "equal_work_hop_over_router_hop": equal_work,
        "equal_work_added_ms": {name: round(hop, 3) for name, (hop, _) in equal_work_hops.items()},
        "session_hop_over_router_hop": round(session_hop / router_hop, 2)
        if router_hop > 0
        else None,
        "p10_session_hop_over_router_hop": round(
            (p10["session_router"] - p10["router"]) / (p10["router"] - p10["worker"]), 2
        )
        if p10["router"] > p10["worker"]
        else None,
    }


def floor_proxy(router_url: str) -> tuple[ServerProcess, str]:
    port = free_port()
    script = Path(__file__).with_name("floor_proxy.py")
    argv = [sys.executable, str(script), str(port), router_url.rsplit(":", 1)[1]]
    url = f"http://127.0.0.1:{port}"
    return ServerProcess(argv, f"{url}/health", timeout_s=60).start(), url


def bench_turns(
    rounds: int, sizes: list[int], tok_dir: Path, floor: bool, allocator: str
) -> dict[str, Any]:
    tok = ChatTokenizer.from_dir(tok_dir)
    wport = free_port()
    results: dict[str, Any] = {}
    worker_argv = [sys.executable, "-c", WORKER, str(wport), str(tok_dir)]
    with ServerProcess(worker_argv, f"http://127.0.0.1:{wport}/health", timeout_s=30):
        worker = f"http://127.0.0.1:{wport}"
        with start_router(RouterSpec(port=free_port())) as router:
            router.add_worker(worker)
            extra = ["--allocator", allocator]
            s_router, s_router_url = session_server(router.url, tok_dir, extra)
            s_worker, s_worker_url = session_server(worker, tok_dir, extra)
            # what the session servers actually run on (mimalloc unless it could not be preloaded)
            results["session_server_allocator"] = httpx.get(
                f"{s_router_url}/health", timeout=10
            ).json()["allocator"]
            urls = {
                "worker": worker,
                "router": router.url,
                "session_router": s_router_url,
                "session_worker": s_worker_url,
            }
            floor_server = None
            if floor:
                floor_server, urls["floor"] = floor_proxy(router.url)
            assert router.pid is not None
            pids = {"router": router.pid, "session_router": s_router.pid}
            try:
                with httpx.Client(timeout=30) as client:
                    for n in sizes:
                        results[f"{n}_tokens"] = measure_size(client, tok, n, rounds, urls, pids)
            finally:
                s_router.stop()
                s_worker.stop()
                if floor_server is not None:
                    floor_server.stop()
    return results


def time_ready(argv: list[str], url: str, timeout_s: float = 120.0) -> float:
    t = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_until_ready(url, timeout_s=timeout_s, process=proc, poll_interval_s=0.01)
        return time.perf_counter() - t
    finally:
        stop_process_group(proc, grace_s=10)


def bench_start(starts: int) -> dict[str, Any]:
    api, cli = [], []
    smg = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    for _ in range(starts):
        t = time.perf_counter()
        handle = start_router(RouterSpec(port=free_port()))
        api.append(time.perf_counter() - t)
        handle.stop()
        port = free_port()
        cli.append(
            time_ready(
                [
                    smg,
                    "launch",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--prometheus-port",
                    str(free_port()),
                    "--log-level",
                    "warn",
                ],
                f"http://127.0.0.1:{port}/health",
            )
        )
    return {
        "python_api_start_to_ready_s": round(statistics.median(api), 3),
        "smg_launch_start_to_ready_s": round(statistics.median(cli), 3),
        "ratio_smg_over_api": round(statistics.median(cli) / statistics.median(api), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 8192])
    p.add_argument("--starts", type=int, default=5)
    p.add_argument("--floor", action="store_true", help="also time floor_proxy.py")
    p.add_argument(
        "--session-allocator",
        choices=ALLOCATORS,
        default=DEFAULT_ALLOCATOR,
        help="the session servers' --allocator (the same default as theirs)",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = build_tokenizer(Path(tmp))
        out = {
            "turn_latency": bench_turns(
                args.rounds, args.sizes, tok_dir, args.floor, args.session_allocator
            ),
            "router_start": bench_start(args.starts),
        }
    out["config"] = {
        "rounds": args.rounds,
        "sizes": args.sizes,
        "starts": args.starts,
        "floor": args.floor,
        "session_allocator": args.session_allocator,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
