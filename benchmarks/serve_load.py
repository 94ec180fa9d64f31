"""Load test of `jaxspec serve`: concurrent clients (the official `openai` client, streaming) at several concurrency
levels against a speculative server and a plain (k = 0) server, both the bundled pair by default.

Both servers run for the whole benchmark (an idle server's engine thread sleeps), and every concurrency level runs
speculative then plain back to back (order alternating over rounds), so each ratio compares runs made under the same
machine load. Per level: per-request output tokens/s, time to first token and inter-token latency (client side), the
aggregate output tokens/s, and from the servers' /metrics the mean accepted length and the mean batch occupancy
(generating rows per cycle) over the level. Prompts: --prompt-set (prompt_sets.py; default 16 HumanEval prompts of at
most 256 tokens), sent as token ids.

    python benchmarks/serve_load.py                       # writes benchmarks/results/serve_load.json and .md
    python benchmarks/serve_load.py --concurrency 1,8 --rounds 1 --max-tokens 32
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import prompt_sets  # this directory (run as a script)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "kimi-py-tiny"
# Set by the test suite's and CI's environment for simulated device meshes (sharding/cpu.py), not by a user serving:
# inherited, it gives a one-device server's XLA:CPU a pool of that many threads on the machine's cores (2 here), and
# served c = 4 levels ran 8-10% fewer tokens/s with it (ad hoc, 2026-12-07).
TEST_ONLY_ENV = ("PJRT_NPROC",)


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a benchmark starts `jaxspec serve` in: this one, with the repository on PYTHONPATH, less the
    test-only settings (TEST_ONLY_ENV), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in TEST_ONLY_ENV}
    return env | {"PYTHONPATH": str(ROOT)} | (extra or {})


def start_server(num_steps: str, args, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "jaxspec", "serve", "--port", str(port), "--num-steps", num_steps]
    argv += ["--max-batch", str(args.max_batch), "--max-context", str(args.max_context), "--log-level", "warning"]
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=server_env())
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, base: str, log: Path) -> None:
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)


def scrape(base: str) -> dict[str, float]:
    """Cumulative counters: cycles, row cycles, accepted drafts (summed over positions), generated tokens."""
    text = httpx.get(f"{base}/metrics").text
    total = lambda name: sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return {
        "cycles": total("jaxspec_cycles_total"),
        "row_cycles": total("jaxspec_row_cycles_total"),
        "accepted": total("jaxspec_draft_accepted_total"),
        "tokens": total("jaxspec_generated_tokens_total"),
    }


def one_request(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> dict[str, float]:
    start = time.perf_counter()
    arrivals, tokens = [], 0
    for chunk in client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},  # the server sends usage only when asked (as OpenAI's does)
    ):
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    first = arrivals[0] if arrivals else end
    return {
        "tokens": tokens,
        "seconds": end - start,
        "ttft": first - start,
        "itl": (end - first) / max(tokens - 1, 1),
        "tok_s": tokens / (end - start),
    }


def level(base: str, prompts: list[list[int]], concurrency: int, requests: int, max_tokens: int) -> dict:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
    before = scrape(base)
    start = time.perf_counter()
    jobs = [prompts[i % len(prompts)] for i in range(requests)]
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_request(client, p, max_tokens), jobs))
    wall = time.perf_counter() - start
    after = scrape(base)
    delta = {k: after[k] - before[k] for k in after}
    tokens = sum(r["tokens"] for r in results)
    stat = lambda key: {
        "mean": float(np.mean([r[key] for r in results])),
        "p50": float(np.median([r[key] for r in results])),
    }  # noqa: E501, E731
    return {
        "concurrency": concurrency,
        "requests": requests,
        "tokens": tokens,
        "seconds": wall,
        "aggregate_tok_s": tokens / wall,
        "per_request_tok_s": stat("tok_s"),
        "ttft_s": stat("ttft"),
        "itl_s": stat("itl"),
        "mean_accepted_length": 1 + delta["accepted"] / max(delta["row_cycles"], 1),
        "mean_occupancy": delta["row_cycles"] / max(delta["cycles"], 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--num-steps",
        default="auto",
        help="speculative server's k (default: auto = adaptive, plain or the tuned chain per segment)",
    )
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve_load")
    prompt_sets.add_arguments(p, count=16, max_tokens=256)  # + --max-tokens: inside --max-context
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from jaxspec import bundled
    from jaxspec.tokenizer import load_tokenizer

    prompt_set = prompt_sets.from_args(args, load_tokenizer(bundled.paths()[0]))
    prompts = prompt_set.ids
    levels = [int(c) for c in args.concurrency.split(",")]
    logs = {mode: Path(tempfile.gettempdir()) / f"serve_load_{mode}.log" for mode in ("speculative", "plain")}
    servers = {
        "speculative": start_server(args.num_steps, args, logs["speculative"]),
        "plain": start_server("0", args, logs["plain"]),
    }
    try:
        for mode, (proc, base) in servers.items():
            wait_ready(proc, base, logs[mode])
            level(base, prompts, 2, 2, 8)  # first requests through every path
        rows = []
        for r in range(args.rounds):
            for c in levels:
                order = ("speculative", "plain") if (r + c) % 2 == 0 else ("plain", "speculative")
                for mode in order:
                    row = level(servers[mode][1], prompts, c, c * args.requests_per_client, args.max_tokens)
                    rows.append({"round": r, "mode": mode, **row})
                    print(
                        f"round {r} {mode:11s} c={c}: {row['aggregate_tok_s']:7.1f} tok/s aggregate, "
                        f"{row['per_request_tok_s']['mean']:6.1f} per request, TTFT {row['ttft_s']['mean']:.3f}s, "
                        f"ITL {row['itl_s']['mean'] * 1e3:.1f}ms, accepted length {row['mean_accepted_length']:.2f},"
                        f" occupancy {row['mean_occupancy']:.2f}",
                        flush=True,
                    )
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
    report = summarize(rows, levels, args) | prompt_set.describe()
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


def summarize(rows: list[dict], levels: list[int], args) -> dict:
    """Per (mode, concurrency): the mean over rounds; the ratios are taken within each round, then averaged."""

    def pick(mode, c):
        return [r for r in rows if r["mode"] == mode and r["concurrency"] == c]

    table = []
    for c in levels:
        for mode in ("speculative", "plain"):
            rs = pick(mode, c)
            table.append(
                {
                    "mode": mode,
                    "concurrency": c,
                    "aggregate_tok_s": float(np.mean([r["aggregate_tok_s"] for r in rs])),
                    "per_request_tok_s": float(np.mean([r["per_request_tok_s"]["mean"] for r in rs])),
                    "ttft_s": float(np.mean([r["ttft_s"]["mean"] for r in rs])),
                    "itl_s": float(np.mean([r["itl_s"]["mean"] for r in rs])),
                    "mean_accepted_length": float(np.mean([r["mean_accepted_length"] for r in rs])),
                    "mean_occupancy": float(np.mean([r["mean_occupancy"] for r in rs])),
                }
            )
    rounds = sorted({r["round"] for r in rows})
    agg = lambda mode, c, rd: next(
        r["aggregate_tok_s"] for r in rows if (r["mode"], r["concurrency"], r["round"]) == (mode, c, rd)
    )  # noqa: E501, E731
    lo, hi = min(levels), max(levels)
    ratios = {
        f"speculative_c{hi}_over_c{lo}": float(
            np.mean([agg("speculative", hi, rd) / agg("speculative", lo, rd) for rd in rounds])
        ),
        f"plain_c{hi}_over_c{lo}": float(np.mean([agg("plain", hi, rd) / agg("plain", lo, rd) for rd in rounds])),
        f"speculative_over_plain_c{lo}": float(
            np.mean([agg("speculative", lo, rd) / agg("plain", lo, rd) for rd in rounds])
        ),
        f"speculative_over_plain_c{hi}": float(
            np.mean([agg("speculative", hi, rd) / agg("plain", hi, rd) for rd in rounds])
        ),
    }
    return {
        "command": prompt_sets.command("benchmarks/serve_load.py", sys.argv[1:], args),
        "model": "bundled pair (assets/kimi-py-tiny)",
        "num_steps": args.num_steps,
        "max_tokens": args.max_tokens,
        "max_batch": args.max_batch,
        "requests_per_client": args.requests_per_client,
        "rounds": args.rounds,
        "platform": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared with other jobs while measured)",
        "ratios": ratios,
        "table": table,
        "rows": rows,
    }


def markdown(report: dict) -> str:
    lines = [
        f"# jaxspec serve load test ({report['model']})",
        "",
        f"`{report['command']}`: greedy, max_tokens {report['max_tokens']}, {report['max_batch']} slots, "
        f"{report['requests_per_client']} requests per client, {report['rounds']} rounds; {report['platform']}.",
        "",
        "| mode | concurrency | aggregate tok/s | per-request tok/s | TTFT s | ITL ms | mean accepted length | "
        "mean occupancy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in report["table"]:
        lines.append(
            f"| {t['mode']} | {t['concurrency']} | {t['aggregate_tok_s']:.1f} | {t['per_request_tok_s']:.1f} | "
            f"{t['ttft_s']:.3f} | {t['itl_s'] * 1e3:.1f} | {t['mean_accepted_length']:.2f} | "
            f"{t['mean_occupancy']:.2f} |"
        )
    lines += ["", "Ratios (within each round, then averaged):", ""]
    lines += [f"- {k}: {v:.2f}x" for k, v in report["ratios"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
