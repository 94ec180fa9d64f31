"""`jaxspec serve` measured with standard clients, at their defaults: aiperf's chat and completions profiles and
lm-eval's `local-completions` (a generate_until and a multiple_choice task), against the bundled pair in a small
configuration.

    python benchmarks/serve_aiperf.py --aiperf BENCH_VENV/bin/aiperf --lm-eval BENCH_VENV/bin/lm_eval

aiperf and lm-eval live in their own environment (`pip install -e .[bench]` there, or `pip install aiperf
'lm-eval[api]'`); the server runs with this interpreter. Each aiperf run sends 20 requests with aiperf's default
request fields (chat: `max_completion_tokens`, streaming with `stream_options.include_usage`), plus
`--extra-inputs ignore_eos:true` so every request yields its full output length, at concurrency 1 and 4, greedy
(temperature 0) and sampled (temperature 0.8, top_p 0.95). The server's mean accepted length of each run comes
from /metrics (accepted drafts / generating row-cycles + 1, the counters' change over the run). Writes
benchmarks/results/serve_aiperf.md and .json (and the raw exports under --work).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_load import server_env  # this directory (run as a script)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "kimi-py-tiny"
TOKENIZER = ROOT / "assets" / "kimi-py-tiny" / "target"
SERVER_FLAGS = ["--max-batch", "4", "--batch-buckets", "1,4", "--max-context", "256"]
GREEDY = ["temperature:0"]
SAMPLED = ["temperature:0.8", "top_p:0.95", "seed:1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log: Path) -> tuple[subprocess.Popen, float]:
    """`jaxspec serve` on `port`; returns the process and the seconds until /health answered 200."""
    argv = [sys.executable, "-m", "jaxspec", "serve", "--port", str(port), *SERVER_FLAGS]
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=server_env())
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"serve_aiperf: the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, time.monotonic() - start
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def counters(base: str) -> tuple[float, float]:
    """(accepted drafts, generating row-cycles) since the server started."""
    text = httpx.get(f"{base}/metrics").text
    accepted = sum(float(v) for v in re.findall(r"^jaxspec_draft_accepted_total\{[^}]*\} (\S+)$", text, re.M))
    rows = re.search(r"^jaxspec_row_cycles_total (\S+)$", text, re.M)
    return accepted, float(rows.group(1)) if rows else 0.0


def aiperf_run(aiperf: str, base: str, name: str, endpoint: str, concurrency: int, extra: list[str], args, work):
    """One aiperf profile; returns (its command, its summary metrics, the run's mean accepted length)."""
    out = work / name
    cmd = [aiperf, "profile", "--model", MODEL, "--url", base, "--endpoint-type", endpoint, "--streaming"]
    cmd += ["--tokenizer", str(TOKENIZER), "--concurrency", str(concurrency), "--request-count", str(args.requests)]
    cmd += ["--isl", str(args.isl), "--isl-stddev", "0", "--osl", str(args.osl), "--random-seed", "0"]
    cmd += ["--ui-type", "none", "--no-gpu-telemetry", "--artifact-dir", str(out)]
    for item in ["ignore_eos:true", *extra]:
        cmd += ["--extra-inputs", item]
    before = counters(base)
    done = subprocess.run(cmd, cwd=work, stdout=(work / f"{name}.log").open("w"), stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"serve_aiperf: aiperf exited {done.returncode}; see {work / name}.log and the server log")
    after = counters(base)
    rows = after[1] - before[1]
    accepted_length = 1 + (after[0] - before[0]) / rows if rows else float("nan")
    summary = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())
    return cmd, summary, accepted_length


def portable(cmd: list[str], work: Path) -> list[str]:
    """`cmd` as the report shows it: executables by name, paths relative to the repository, the raw exports as WORK."""
    root, work = f"{ROOT}/", str(work)
    out = [Path(cmd[0]).name if "/" in cmd[0] else cmd[0]]
    for word in cmd[1:]:
        if "/bin/" in word and Path(word).name in ("aiperf", "lm_eval"):
            word = Path(word).name
        out.append(word.replace(work, "WORK").replace(root, ""))
    return out


def fmt_load(load) -> str:
    return "(" + ", ".join(f"{x:.1f}" for x in load) + ")"


def metric(summary: dict, name: str, stat: str = "avg") -> float:
    value = summary.get(name) or summary.get("records", {}).get(name) or {}
    return float(value.get(stat, "nan")) if isinstance(value, dict) else float("nan")


LM_EVAL_TASKS = ("jaxspec_py_complete", "jaxspec_py_choice")


def lm_eval_run(lm_eval: str, base: str, work: Path) -> tuple[list[str], dict]:
    """lm-eval local-completions (tokenized_requests=True, its default) on the local generate_until and
    multiple_choice tasks; returns the command and each task's scores."""
    model_args = f"model={MODEL},base_url={base}/v1/completions,tokenizer={TOKENIZER},num_concurrent=1,max_retries=1"
    cmd = [lm_eval, "--model", "local-completions", "--model_args", model_args, "--batch_size", "4"]
    cmd += ["--tasks", ",".join(LM_EVAL_TASKS), "--include_path", str(ROOT / "benchmarks" / "lm_eval_tasks")]
    cmd += ["--output_path", str(work / "lm_eval"), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    log = (work / "lm_eval.log").open("w")
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    results = json.loads(max((work / "lm_eval").rglob("results_*.json"), key=os.path.getmtime).read_text())
    return cmd, {task: results["results"][task] for task in LM_EVAL_TASKS}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--aiperf", default="aiperf", help="the aiperf executable (%(default)s)")
    p.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable; '' to skip (%(default)s)")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--isl", type=int, default=64, help="prompt tokens (%(default)s)")
    p.add_argument("--osl", type=int, default=48, help="output tokens requested (%(default)s)")
    p.add_argument("--work", type=Path, default=None, help="raw exports (default: a new temporary directory)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve_aiperf.md")
    args = p.parse_args()
    args.work = args.work or Path(tempfile.mkdtemp(prefix="serve_aiperf-"))
    args.work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    load = {"start": os.getloadavg()}
    proc, startup = start_server(port, args.work / "server.log")
    try:
        runs = [
            (f"{endpoint}_{kind}_c{c}", endpoint, c, extra)
            for endpoint in ("chat", "completions")
            for kind, extra in (("greedy", GREEDY), ("sampled", SAMPLED))
            for c in (1, 4)
        ]
        results = [
            (name, c, extra, *aiperf_run(args.aiperf, base, name, ep, c, extra, args, args.work))
            for name, ep, c, extra in runs
        ]
        lm = lm_eval_run(args.lm_eval, base, args.work) if args.lm_eval else None
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    load["end"] = os.getloadavg()
    args.out.write_text(report(args, startup, results, lm, load))
    args.out.with_suffix(".json").write_text(json.dumps(raw(args, startup, results, lm, load), indent=2) + "\n")
    print(args.out.read_text())
    return 0


def raw(args, startup: float, results, lm, load: dict) -> dict:
    """The figures of the report, and each run's aiperf summary as aiperf exported it."""
    return {
        "server": ["jaxspec", "serve", *SERVER_FLAGS],
        "seconds_to_health": round(startup, 1),
        "loadavg": {k: [round(x, 2) for x in v] for k, v in load.items()},
        "requests": args.requests,
        "isl": args.isl,
        "osl": args.osl,
        "aiperf": [
            {
                "run": name,
                "concurrency": c,
                "extra_inputs": extra,
                "command": portable(cmd, args.work),
                "mean_accepted_length": a,
                "summary": {k: v for k, v in s.items() if isinstance(v, dict) and "avg" in v},
            }
            for name, c, extra, cmd, s, a in results
        ],
        "lm_eval": None if lm is None else {"command": portable(lm[0], args.work), "results": lm[1]},
    }


def report(args, startup: float, results, lm, load: dict) -> str:
    server = shlex.join(["jaxspec", "serve", *SERVER_FLAGS])
    invocation = shlex.join(portable(["python", "benchmarks/serve_aiperf.py", *sys.argv[1:]], args.work))
    lines = [
        "# jaxspec serve under aiperf and lm-eval (bundled pair)",
        "",
        f"Written by `{invocation}` (aiperf and lm-eval "
        "in their own venv). CPU only, the project's shared "
        f"{os.cpu_count()}-core machine (other work ran beside it: load average (1, 5, 15 min) "
        f"{fmt_load(load['start'])} at the start, {fmt_load(load['end'])} at the end; the timings are noisy, "
        f"compare rows of this table, not machines). Server: `{server}` "
        f"(k = the bundled tuning's), ready (/health 200) {startup:.0f} s after launch. Each run: {args.requests} "
        f"requests, {args.isl} prompt tokens, {args.osl} output tokens (`--osl`, sent as aiperf's default field: "
        "`max_completion_tokens` for chat, `max_tokens` for completions), streaming, `--extra-inputs "
        "ignore_eos:true`.",
        "",
        "| run | conc. | extra inputs | ok / sent | TTFT mean (ms) | TTFT p90 (ms) | ITL mean (ms) "
        "| output tok/s | req/s | mean accepted length |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c, extra, _, s, accepted in results:
        ok = metric(s, "request_count")
        errors = metric(s, "error_request_count")
        sent = ok + (0 if errors != errors else errors)
        lines.append(
            f"| {name.rsplit('_c', 1)[0]} | {c} | {' '.join(extra)} | {ok:.0f} / {sent:.0f} "
            f"| {metric(s, 'time_to_first_token'):.0f} | {metric(s, 'time_to_first_token', 'p90'):.0f} "
            f"| {metric(s, 'inter_token_latency'):.1f} | {metric(s, 'output_token_throughput'):.1f} "
            f"| {metric(s, 'request_throughput'):.2f} | {accepted:.2f} |"
        )
    note = "aiperf commands (the first of each endpoint; the others change `--concurrency` and the extra inputs):"
    lines += ["", note, "", "```bash"]
    seen = set()
    for name, _, _, cmd, _, _ in results:
        endpoint = name.split("_")[0]
        if endpoint not in seen:
            seen.add(endpoint)
            lines.append(shlex.join(portable(cmd, args.work)))
    lines += ["```", ""]
    if lm is not None:
        cmd, scores = lm
        shown = {t: {k: v for k, v in r.items() if isinstance(v, int | float)} for t, r in scores.items()}
        lines += [
            "lm-eval `local-completions` (its default `tokenized_requests=True`: prompts go as token-id lists, "
            "4 per request) on two local tasks under `benchmarks/lm_eval_tasks/`: `jaxspec_py_complete` "
            "(generate_until, 12 one-line Python completions, exact match) and `jaxspec_py_choice` (multiple_choice, "
            "8 questions of 3 continuations, scored by loglikelihood through `echo` + `logprobs`):",
            "",
            "```json",
            json.dumps(shown, indent=2),
            "```",
            "",
            "```bash",
            shlex.join(portable(cmd, args.work)),
            "```",
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
