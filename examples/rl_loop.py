"""A toy RL loop: a trainer process nudges the weights, the engine rolls out between steps.

    python examples/rl_loop.py                     # the embedded demo model, 3 iterations
    python examples/rl_loop.py --model DIR --iterations 5 --tensor-parallel-size 2

The shape of what verl / OpenRLHF / TRL drive, at toy scale:

- the trainer is its own process holding a float32 copy of the model (transformers), and
  rank 0 of a gloo process group the engine's ranks join (``LLM.init_weight_update_group``);
- each iteration the engine (``LLM(enable_sleep_mode=True)``) samples completions, which
  go to the trainer with a toy reward (the share of vowels in the text); the engine sleeps
  (level 2: KV cache and weights freed) while the trainer takes one REINFORCE step;
  then the trainer broadcasts every tensor and the engine loads them
  (``LLM.update_weights_from_distributed``) and wakes up (only the KV cache is allocated:
  the update brought the weights back);
- per iteration it prints the time of generate, sleep, update and wake_up, the update's
  bytes and effective GB/s, and next to it the bandwidth of one plain gloo broadcast of
  the same bytes between the same two processes (what the communicator can do; the update
  also builds and repacks the model on every rank).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

import torch

VOWELS = set("aeiouAEIOU")


def reward(text: str) -> float:
    """The toy objective: the share of vowels among the letters."""
    letters = [c for c in text if c.isalpha()]
    return sum(c in VOWELS for c in letters) / max(1, len(letters))


# -- the trainer (its own process) --------------------------------------------------------------
def trainer_main(model_dir: str, port: int, world_size: int, conn: Any, lr: float,
                 seed: int, threads: int) -> None:
    """Rank 0 of the weight-sync group (it hosts the store) and of the bandwidth probe
    group; per iteration: take the rollouts, one SGD step, broadcast the weights."""
    from transformers import AutoModelForCausalLM

    from engine.distributed.weight_sync import broadcast_named_tensors, create_weight_sync_group

    torch.manual_seed(seed)
    torch.set_num_threads(threads)  # leave the engine's cores to it between steps
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    wire_dtype = getattr(torch, conn.recv())  # the engine's weight dtype
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    weights = unique_tensors(model)
    conn.send(([n for n, _ in weights], [str(wire_dtype).removeprefix("torch.")] * len(weights),
               [list(t.shape) for _, t in weights]))
    group = create_weight_sync_group("127.0.0.1", port, 0, world_size)
    probe = create_weight_sync_group("127.0.0.1", port + 1, 0, 2)
    while (rollouts := conn.recv()) is not None:
        started = time.perf_counter()
        train_step(model, optimizer, rollouts)
        tensors = [(n, t.detach().to(wire_dtype)) for n, t in unique_tensors(model)]
        conn.send(time.perf_counter() - started)
        # the engine's ranks receive, a few byte buckets instead of one call per tensor
        sent = broadcast_named_tensors(group, tensors, packed=True)
        flat = torch.empty(sent, dtype=torch.uint8)
        probe.broadcast(flat, src=0)  # the same bytes, one plain broadcast


def unique_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The model's checkpoint tensors, a tied one once (an LM head tied to the embedding
    is not sent: the engine ties it again)."""
    seen: set[int] = set()
    out = []
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            out.append((name, tensor))
    return out


def train_step(model: Any, optimizer: Any, rollouts: list[tuple[list[int], list[int], float]]
               ) -> None:
    """One REINFORCE step (Adam) with a mean baseline: raise the log-probability of the
    completions that scored above the batch's mean."""
    baseline = sum(r for _, _, r in rollouts) / len(rollouts)
    optimizer.zero_grad()
    for prompt, completion, score in rollouts:
        ids = torch.tensor([prompt + completion])
        logits = model(ids).logits[0, len(prompt) - 1:-1]
        logprob = logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).sum()
        (-(score - baseline) * logprob / len(rollouts)).backward()
    optimizer.step()


# -- the engine side ----------------------------------------------------------------------------
def run(args: argparse.Namespace) -> list[dict[str, float]]:
    from engine import LLM, SamplingParams
    from engine.distributed.weight_sync import create_weight_sync_group
    from engine.model_executor.multiproc_executor import free_port

    llm = LLM(args.model, enable_sleep_mode=True, tensor_parallel_size=args.tensor_parallel_size,
              max_model_len=args.max_model_len, cpu_kvcache_space_gib=args.kv_cache_gib,
              seed=args.seed)
    config = llm.llm_engine.config
    world_size = 1 + args.tensor_parallel_size
    port = free_port()
    here, there = mp.Pipe()
    trainer = mp.get_context("spawn").Process(
        target=trainer_main, args=(config.model.model, port, world_size, there, args.lr,
                                   args.seed, args.trainer_threads), daemon=True)
    trainer.start()
    rows = []
    try:
        here.send(config.model.dtype)
        names, dtypes, shapes = here.recv()
        llm.init_weight_update_group("127.0.0.1", port, 1, world_size)
        probe = create_weight_sync_group("127.0.0.1", port + 1, 1, 2)
        prompts = [f"{topic} is" for topic in ("The package", "This file", "A user",
                                               "The manual", "Your system", "The server",
                                               "A library", "The kernel")][:args.prompts]
        params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
        for it in range(args.iterations):
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            t1 = time.perf_counter()
            rollouts = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids),
                         reward(o.outputs[0].text)) for o in outputs]
            here.send(rollouts)  # the trainer steps while the engine sleeps
            llm.sleep(level=2)
            t2 = time.perf_counter()
            train_s = here.recv()
            t3 = time.perf_counter()
            llm.update_weights_from_distributed(names, dtypes, shapes, packed=True)
            t4 = time.perf_counter()
            llm.wake_up()
            t5 = time.perf_counter()
            nbytes = sum(torch.Size(s).numel() for s in shapes) * getattr(
                torch, dtypes[0]).itemsize
            flat = torch.empty(nbytes, dtype=torch.uint8)
            t6 = time.perf_counter()
            probe.broadcast(flat, src=0)
            probe_s = time.perf_counter() - t6
            row = {"iteration": it, "reward": sum(r for *_, r in rollouts) / len(rollouts),
                   "generate_s": t1 - t0, "sleep_s": t2 - t1, "train_s": train_s,
                   "update_s": t4 - t3, "wake_up_s": t5 - t4, "bytes": nbytes,
                   "update_gbps": nbytes / (t4 - t3) / 1e9,
                   "broadcast_gbps": nbytes / probe_s / 1e9}
            rows.append(row)
            print(f"iter {it}: reward {row['reward']:.3f} | generate {row['generate_s']:.3f} s"
                  f" | sleep {row['sleep_s']:.3f} s | train {train_s:.3f} s | update "
                  f"{row['update_s']:.3f} s ({nbytes / 2**20:.1f} MiB, "
                  f"{row['update_gbps']:.2f} GB/s; gloo broadcast "
                  f"{row['broadcast_gbps']:.2f} GB/s) | wake_up {row['wake_up_s']:.3f} s",
                  flush=True)
        here.send(None)
        trainer.join(timeout=60)
    finally:
        if trainer.is_alive():
            trainer.kill()
        llm.shutdown()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the demo)")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="rollouts per iteration (<= 8)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainer-threads", type=int, default=1)
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
