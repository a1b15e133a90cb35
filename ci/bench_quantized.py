#!/usr/bin/env python3
"""Quantized checkpoints vs their bf16 original: decode, throughput and prefill, one table.

For every model directory given (default: /tmp/engine-bench-models/llama-small and those of
its quantized copies llama-small-{w4a16-g128, fp8-dynamic, fp8-static, fp8-block, w8a8-int8,
nvfp4, nvfp4a16} that exist), ``engine bench`` runs as a subprocess in three settings:

* latency:    ``engine bench latency``, 1 request, --latency-in (128) in / --latency-out
              (128) out: decode ms per output token after the first -> decode tok/s;
* throughput: ``engine bench throughput``, --num-prompts (64) x (--input-len 128 in,
              --output-len 128 out), all submitted at once: output tok/s (wall time
              includes the prefill of the 64 prompts);
* prefill:    ``engine bench latency``, 1 request of --prefill-len (1024) ids, 1 output
              token: prefill tok/s = prefill_len / time to first token.

Each subprocess gets ``--warmup`` (1) unmeasured rounds and ``--repeats`` (3) measured ones;
the figures are the medians. With ``--interleave`` every measured round is its own
subprocess instead (``--repeats 1``), rounds cycling through the models, so a burst of load
from elsewhere hits every model alike (each round pays a load and a warmup). Prefix
caching is OFF by default (``--no-enable-prefix-caching``): the benchmarks rerun the same
prompts, and with caching on every measured round after the warmup would find its prompt
already cached (prefill would measure nothing, throughput would skip the prompts);
``--prefix-caching`` keeps the engine's default instead. Every other engine option keeps
the engine's default; ``--engine-args`` appends more, as one string joined with ``=``
(e.g. ``--engine-args="--kv-cache-space 8"``).

``--llama-cpp-dir DIR`` adds llama.cpp as the peer: for every ``*.gguf`` in DIR (or
``--gguf FILE ...``), ``llama-bench -p 512 -n 128 -t THREADS -r REPEATS -o json`` (prefill =
pp512, decode = tg128, medians of the samples) and, when ``llama-batched-bench`` is there,
``-npl NUM_PROMPTS -npp INPUT_LEN -ntg OUTPUT_LEN`` for the throughput column (output tokens
/ total time, like the engine's). The binaries are looked up in DIR/build/bin, DIR/bin, DIR.
llama.cpp rows' ratios are against the llama.cpp bf16 gguf (a file named *bf16*), engine
rows' against the engine's bf16 model (the first without a quantization_config, or
``--baseline``).

The table (markdown) goes to stdout, headed by the CPU model (/proc/cpuinfo), the engine's
ISA level (the bench JSON's runtime info), threads and load average; ``--out FILE`` also
writes every raw result (the bench JSONs, llama.cpp's JSON) to FILE. The engine's logs of
each run go to --log-dir (default: a temporary directory, named in the output). Weight
MiB is what the engine reports as ``weights_mib`` (its in-memory weights, which for a
kernel that unpacks the checkpoint can exceed the file); file MiB is the *.safetensors
size on disk (for gguf: llama-bench's model size).

Not part of CI. Measure on a quiet machine (load average ~0); on a shared one figures move.

    python tools/make_bench_models.py            # once: /tmp/engine-bench-models/llama-small
    python ci/bench_quantized.py --out /tmp/bench_quantized.json \\
        --llama-cpp-dir /tmp/llamacpp            # the full run
    python ci/bench_quantized.py /tmp/engine-bench-models/llama-small \\
        /tmp/engine-bench-models/llama-small-w4a16-g128 --repeats 1 --warmup 0 \\
        --latency-in 16 --latency-out 8 --num-prompts 4 --input-len 16 --output-len 8 \\
        --prefill-len 64                         # a quick smoke run
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_ROOT = Path("/tmp/engine-bench-models")
BASE_NAME = "llama-small"
QUANT_SUFFIXES = ("w4a16-g128", "fp8-dynamic", "fp8-static", "fp8-block", "w8a8-int8",
                  "nvfp4", "nvfp4a16")
SETTINGS = ("latency", "throughput", "prefill")


def default_models() -> list[str]:
    base = BENCH_ROOT / BASE_NAME
    candidates = [base] + [BENCH_ROOT / f"{BASE_NAME}-{s}" for s in QUANT_SUFFIXES]
    return [str(p) for p in candidates if (p / "config.json").is_file()]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def usable_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def quantization_summary(model_dir: str) -> dict | None:
    """The checkpoint's quantization_config, reduced to what names the scheme."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    q = config.get("quantization_config")
    if not q:
        return None
    summary = {"quant_method": q.get("quant_method"), "format": q.get("format"),
               "ignore": q.get("ignore")}
    groups = {}
    for name, group in (q.get("config_groups") or {}).items():
        def args(a):
            if not a:
                return None
            keys = ("num_bits", "type", "symmetric", "strategy", "group_size",
                    "block_structure", "dynamic")
            return {k: a.get(k) for k in keys if a.get(k) is not None}
        groups[name] = {"weights": args(group.get("weights")),
                        "input_activations": args(group.get("input_activations"))}
    if groups:
        summary["config_groups"] = groups
    if q.get("quant_method") in ("gptq", "awq"):
        for key in ("bits", "group_size", "desc_act", "sym", "zero_point", "version"):
            if key in q:
                summary[key] = q[key]
    return summary


def file_mib(model_dir: str) -> float | None:
    files = glob.glob(os.path.join(model_dir, "*.safetensors"))
    return round(sum(os.path.getsize(f) for f in files) / 2**20, 1) if files else None


def scheme_name(model_dir: str, baseline_dir: str | None) -> str:
    name = Path(model_dir).name
    if baseline_dir:
        base = Path(baseline_dir).name
        if model_dir == baseline_dir:
            try:
                config = json.loads((Path(model_dir) / "config.json").read_text())
                dtype = str(config.get("dtype") or config.get("torch_dtype") or name)
                return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
            except (OSError, ValueError):
                return name
        if name.startswith(base + "-"):
            return name[len(base) + 1:]
    return name


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class EngineRunner:
    def __init__(self, args: argparse.Namespace, log_dir: Path):
        self.args = args
        self.log_dir = log_dir
        self.engine_cmd = shlex.split(args.engine_cmd) if args.engine_cmd else [
            sys.executable, "-m", "engine.cli"]
        self.count = 0

    def command(self, model: str, setting: str, repeats: int, json_path: Path) -> list[str]:
        a = self.args
        if setting == "latency":
            mode, shape = "latency", ["--input-len", a.latency_in, "--output-len", a.latency_out]
        elif setting == "throughput":
            mode, shape = "throughput", ["--num-prompts", a.num_prompts,
                                         "--input-len", a.input_len, "--output-len", a.output_len]
        else:
            mode, shape = "latency", ["--input-len", a.prefill_len, "--output-len", 1]
        cmd = [*self.engine_cmd, "bench", mode, "--model", model, *map(str, shape),
               "--warmup", str(a.warmup), "--repeats", str(repeats),
               "--num-threads", str(a.threads), "--json", str(json_path)]
        if not a.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if a.max_model_len:
            cmd += ["--max-model-len", str(a.max_model_len)]
        return cmd + shlex.split(a.engine_args)

    def run(self, model: str, setting: str, repeats: int) -> dict:
        self.count += 1
        stem = f"{self.count:03d}-{Path(model).name}-{setting}"
        json_path = self.log_dir / f"{stem}.json"
        log_path = self.log_dir / f"{stem}.log"
        cmd = self.command(model, setting, repeats, json_path)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        print(f"[bench_quantized] {setting}: {Path(model).name} "
              f"(log {log_path})", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            with open(log_path, "w") as log:
                log.write("$ " + shlex.join(cmd) + "\n")
                log.flush()
                proc = subprocess.run(cmd, check=False, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      timeout=self.args.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        wall = round(time.perf_counter() - start, 1)
        record = {"cmd": cmd, "rc": rc, "wall_s": wall, "log": str(log_path)}
        if rc == 0 and json_path.is_file():
            record["bench"] = json.loads(json_path.read_text())
        else:
            record["error"] = _tail(log_path)
            print(f"[bench_quantized]   failed (rc {rc}):\n{record['error']}", file=sys.stderr,
                  flush=True)
        return record


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else None


def engine_figures(model: str, records: dict[str, list[dict]], args) -> dict:
    """Medians over every measured run of every subprocess of one model."""
    def runs(setting: str, key: str) -> list[float]:
        out = []
        for rec in records.get(setting, []):
            if "bench" in rec:
                out += [float(v) for v in rec["bench"]["results"][key]["runs"]]
        return out

    figures: dict = {"errors": {s: r["error"] for s, recs in records.items() for r in recs
                                if "error" in r}}
    decode_ms = _median(runs("latency", "decode_ms_per_token"))
    figures["decode_ms_per_token"] = decode_ms
    figures["decode_tok_s"] = 1e3 / decode_ms if decode_ms else None
    figures["latency_ttft_ms"] = _median(runs("latency", "ttft_ms"))
    figures["throughput_tok_s"] = _median(runs("throughput", "output_tok_s"))
    expected = args.num_prompts * args.output_len
    for rec in records.get("throughput", []):
        produced = rec.get("bench", {}).get("results", {}).get("output_tokens")
        if produced is not None and produced != expected:
            figures["errors"]["throughput"] = f"{produced} output tokens, expected {expected}"
    ttft = _median(runs("prefill", "ttft_ms"))
    figures["prefill_ttft_ms"] = ttft
    figures["prefill_tok_s"] = args.prefill_len / (ttft / 1e3) if ttft else None
    for recs in records.values():
        for rec in recs:
            bench = rec.get("bench")
            if bench and bench.get("runtime"):
                figures["runtime"] = bench["runtime"]
                figures["environment"] = bench.get("environment")
                break
        if "runtime" in figures:
            break
    runtime = figures.get("runtime") or {}
    figures["weights_mib"] = runtime.get("weights_mib")
    return figures


def find_binary(root: Path, name: str) -> Path | None:
    for d in (root / "build" / "bin", root / "bin", root):
        if (d / name).is_file() and os.access(d / name, os.X_OK):
            return d / name
    return None


def run_llama_cpp(args, log_dir: Path) -> list[dict]:
    root = Path(args.llama_cpp_dir)
    bench = find_binary(root, "llama-bench")
    batched = find_binary(root, "llama-batched-bench")
    if bench is None:
        print(f"[bench_quantized] no llama-bench under {root}", file=sys.stderr)
        return []
    ggufs = args.gguf or sorted(glob.glob(str(root / "*.gguf")))
    results = []
    for gguf in ggufs:
        name = Path(gguf).name
        entry: dict = {"gguf": gguf, "scheme": f"llama.cpp {Path(gguf).stem}"}
        cmd = [str(bench), "-m", gguf, "-t", str(args.threads), "-p", str(args.llama_pp),
               "-n", str(args.llama_tg), "-r", str(args.repeats), "-o", "json"]
        print(f"[bench_quantized] llama-bench: {name}", file=sys.stderr, flush=True)
        entry["bench_cmd"] = cmd
        try:
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True,
                                  timeout=args.timeout)
            (log_dir / f"llama-bench-{name}.log").write_text(proc.stderr)
            if proc.returncode != 0:
                entry["error"] = proc.stderr[-2000:]
            else:
                entry["llama_bench"] = json.loads(proc.stdout)
        except (subprocess.TimeoutExpired, ValueError) as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
        for test in entry.get("llama_bench", []):
            median = _median(test.get("samples_ts") or [test.get("avg_ts")])
            if test.get("n_prompt") and not test.get("n_gen"):
                entry["prefill_tok_s"] = median
            elif test.get("n_gen") and not test.get("n_prompt"):
                entry["decode_tok_s"] = median
            entry["file_mib"] = round(test["model_size"] / 2**20, 1)
            entry["cpu_info"] = test.get("cpu_info")
            entry["build_commit"] = test.get("build_commit")
        if batched is not None and not args.no_llama_batched and "throughput" in args.settings:
            n_ctx = args.num_prompts * (args.input_len + args.output_len)
            cmd = [str(batched), "-m", gguf, "-t", str(args.threads), "-c", str(n_ctx),
                   "-b", "2048", "-ub", "512", "-npp", str(args.input_len),
                   "-ntg", str(args.output_len), "-npl", str(args.num_prompts),
                   "--output-format", "jsonl"]
            entry["batched_cmd"] = cmd
            print(f"[bench_quantized] llama-batched-bench: {name}", file=sys.stderr, flush=True)
            rows = []
            for i in range(args.repeats):
                try:
                    proc = subprocess.run(cmd, check=False, capture_output=True, text=True,
                                          timeout=args.timeout)
                    (log_dir / f"llama-batched-bench-{name}-{i}.log").write_text(proc.stderr)
                    if proc.returncode != 0:
                        entry["batched_error"] = proc.stderr[-2000:]
                        break
                    rows += [json.loads(line) for line in proc.stdout.splitlines()
                             if line.startswith("{")]
                except (subprocess.TimeoutExpired, ValueError) as exc:
                    entry["batched_error"] = f"{type(exc).__name__}: {exc}"
                    break
            entry["llama_batched_bench"] = rows
            # output tokens over the whole run (prompts included), as the engine counts
            tok_s = [r["pl"] * r["tg"] / r["t"] for r in rows if r.get("t")]
            entry["throughput_tok_s"] = _median(tok_s)
        results.append(entry)
    return results


def fmt(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def ratio(value, base) -> str:
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x"


def render(report: dict) -> str:
    a = report["settings"]
    title = (f"## Quantized checkpoints on {report['cpu_model']}: engine "
             f"{report['isa_level'] or '?'} kernels, {a['threads']} threads")
    parts = []
    if "latency" in a["settings"]:
        parts.append(f"decode: 1 x ({a['latency_in']} in, {a['latency_out']} out)")
    if "throughput" in a["settings"]:
        parts.append(f"throughput: {a['num_prompts']} x ({a['input_len']} in, "
                     f"{a['output_len']} out)")
    if "prefill" in a["settings"]:
        parts.append(f"prefill: 1 x {a['prefill_len']} in")
    if report.get("llama_cpp"):
        parts.append(f"llama.cpp: pp{a['llama_pp']} / tg{a['llama_tg']}"
                     + ("" if a["no_llama_batched"] else
                        f" / batched {a['num_prompts']} x ({a['input_len']}, {a['output_len']})"))
    shape = (f"engine {report.get('engine_commit') or '?'} - {'; '.join(parts)}; medians of "
             f"{a['repeats']} ({'interleaved processes' if a['interleave'] else 'rounds per process'}"
             f"), warmup {a['warmup']}; prefix caching {'on' if a['prefix_caching'] else 'off'}; "
             f"load avg {report['load_avg']}")
    header = ("| scheme | weight MiB | file MiB | decode tok/s | vs bf16 | throughput tok/s "
              "| vs bf16 | prefill tok/s | vs bf16 | GEMMs |")
    lines = [title, "", shape, "", header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    base = next((m for m in report["engine"] if m["baseline"]), None)
    for m in report["engine"]:
        f = m["figures"]
        b = base["figures"] if base else {}
        kernels = ", ".join(f"{k} x{v}" for k, v in
                            ((f.get("runtime") or {}).get("gemm_kernels") or {}).items())
        scheme = m["scheme"] + (" (error)" if f["errors"] else "")
        lines.append(
            f"| {scheme} | {fmt(f.get('weights_mib'))} | {fmt(m.get('file_mib'))} "
            f"| {fmt(f['decode_tok_s'])} | {ratio(f['decode_tok_s'], b.get('decode_tok_s'))} "
            f"| {fmt(f['throughput_tok_s'])} "
            f"| {ratio(f['throughput_tok_s'], b.get('throughput_tok_s'))} "
            f"| {fmt(f['prefill_tok_s'])} | {ratio(f['prefill_tok_s'], b.get('prefill_tok_s'))} "
            f"| {kernels or '-'} |")
    peers = report.get("llama_cpp") or []
    pbase = next((p for p in peers if "bf16" in Path(p["gguf"]).name.lower()), None) or {}
    for p in peers:
        scheme = p["scheme"] + (" (error)" if "error" in p or "batched_error" in p else "")
        lines.append(
            f"| {scheme} | - | {fmt(p.get('file_mib'))} | {fmt(p.get('decode_tok_s'))} "
            f"| {ratio(p.get('decode_tok_s'), pbase.get('decode_tok_s'))} "
            f"| {fmt(p.get('throughput_tok_s'))} "
            f"| {ratio(p.get('throughput_tok_s'), pbase.get('throughput_tok_s'))} "
            f"| {fmt(p.get('prefill_tok_s'))} "
            f"| {ratio(p.get('prefill_tok_s'), pbase.get('prefill_tok_s'))} | llama.cpp |")
    return "\n".join(lines)


def engine_commit() -> str | None:
    repo = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                             check=False, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage="%(prog)s [MODEL_DIR ...] [--repeats N] [--out FILE] [--llama-cpp-dir DIR] ...")
    parser.add_argument("models", nargs="*",
                        help="HF model dirs (default: llama-small and its quantized copies "
                             "under /tmp/engine-bench-models that exist)")
    parser.add_argument("--baseline", default=None,
                        help="The bf16 model the ratios are against (default: the first "
                             "model without a quantization_config)")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="Comma list of latency, throughput, prefill (default: all)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--interleave", action="store_true",
                        help="One subprocess per measured round, rounds cycling over the models")
    parser.add_argument("--latency-in", type=int, default=128)
    parser.add_argument("--latency-out", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None,
                        help="Engine --num-threads and llama.cpp -t (default: the CPUs this "
                             "process may use)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--prefix-caching", action="store_true",
                        help="Keep the engine's prefix caching on (default: off, see above)")
    parser.add_argument("--engine-cmd", default=None,
                        help="The engine command (default: this python -m engine.cli)")
    parser.add_argument("--engine-args", default="",
                        help='Extra options for every engine bench run, one string: '
                             '--engine-args="--kv-cache-space 8"')
    parser.add_argument("--timeout", type=float, default=7200.0,
                        help="Seconds one subprocess may run")
    parser.add_argument("--llama-cpp-dir", default=None,
                        help="llama.cpp dir with build/bin/llama-bench (and "
                             "llama-batched-bench) and the *.gguf files: adds the peer rows")
    parser.add_argument("--gguf", nargs="+", default=None,
                        help="gguf files to bench (default: every *.gguf in --llama-cpp-dir)")
    parser.add_argument("--llama-pp", type=int, default=512)
    parser.add_argument("--llama-tg", type=int, default=128)
    parser.add_argument("--no-llama-batched", action="store_true",
                        help="Skip llama-batched-bench (the llama.cpp throughput column)")
    parser.add_argument("--out", default=None, help="Write the raw results JSON here")
    parser.add_argument("--log-dir", default=None,
                        help="Logs and bench JSONs of every run (default: a temp dir)")
    args = parser.parse_args(argv)
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = set(args.settings) - set(SETTINGS)
    if unknown:
        parser.error(f"unknown settings {sorted(unknown)} (choose from {', '.join(SETTINGS)})")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    if "latency" in args.settings and args.latency_out < 2:
        parser.error("--latency-out must be >= 2 (decode needs a second token)")
    args.threads = args.threads or usable_threads()
    models = [str(Path(m)) for m in (args.models or default_models())]
    if not models and not args.llama_cpp_dir:
        parser.error("no model directories (none given, none found under /tmp/engine-bench-models)")
    for m in models:
        if not (Path(m) / "config.json").is_file():
            parser.error(f"{m}: no config.json")
    baseline = (str(Path(args.baseline)) if args.baseline else
                next((m for m in models if quantization_summary(m) is None), None))
    log_dir = (Path(args.log_dir) if args.log_dir
               else Path(tempfile.mkdtemp(prefix="bench_quantized-")))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[bench_quantized] logs in {log_dir}", file=sys.stderr, flush=True)

    runner = EngineRunner(args, log_dir)
    records: dict[str, dict[str, list[dict]]] = {m: {} for m in models}
    rounds, per_process = (args.repeats, 1) if args.interleave else (1, args.repeats)
    for _ in range(rounds):
        for model in models:
            for setting in args.settings:
                records[model].setdefault(setting, []).append(
                    runner.run(model, setting, per_process))

    engine_rows = []
    for model in models:
        engine_rows.append({
            "model": model,
            "scheme": scheme_name(model, baseline),
            "baseline": model == baseline,
            "quantization_config": quantization_summary(model),
            "file_mib": file_mib(model),
            "figures": engine_figures(model, records[model], args),
            "runs": records[model],
        })
    peers = run_llama_cpp(args, log_dir) if args.llama_cpp_dir else []

    isa = next((r["figures"]["runtime"].get("isa_level") for r in engine_rows
                if r["figures"].get("runtime")), None)
    report = {
        "cpu_model": cpu_model(),
        "isa_level": isa,
        "engine_commit": engine_commit(),
        "load_avg": round(os.getloadavg()[0], 2),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": {k: v for k, v in vars(args).items() if k not in ("models",)},
        "log_dir": str(log_dir),
        "engine": engine_rows,
        "llama_cpp": peers,
    }
    table = render(report)
    report["table"] = table
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nraw results: {args.out}", file=sys.stderr)
    failed = any(r["figures"]["errors"] for r in engine_rows) or any(
        "error" in p for p in peers)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
