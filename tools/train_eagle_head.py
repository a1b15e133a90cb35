#!/usr/bin/env python3
"""Train the EAGLE-1 speculative-decoding head shipped in ``engine/assets/demo-eagle``.

The head drafts tokens for the demo model (``engine/assets/demo``) from the demo
model's own last hidden states. It is trained on the demo model's corpus so that it
learns to imitate the demo model where the demo model is actually used. This script
is run once by hand (never in CI); the directory it writes is committed.

Pipeline (everything except the exported directory lives in ``--work-dir``):

1. The corpus of ``tools/train_demo_model.py`` (its Debian packages, cleaning, the
   same fixed ~2% held-out documents and synthetic chats), tokenized with the
   *shipped* demo tokenizer, so that token ids match the frozen target exactly.
   Cached in ``work/eagle_data.pt``.
2. The frozen demo model (transformers, float32) gives, for each training window,
   its final-normed hidden states ``h_i`` and logits. The head sees
   ``(embed(t_{i+1}), h_i)`` at position ``i`` and is trained (EAGLE's objective) to
   regress ``h_{i+1}`` (smooth L1) and to match the target's next-token
   distribution at ``i+1`` through the target's ``lm_head`` (soft cross-entropy).
3. Held-out top-1 agreement of the head's argmax with the target's argmax at
   ``i+2`` (the acceptance-rate proxy of the first drafted token) is reported and
   written into the model card; the bf16 export is checked again through the
   engine's own ``EagleLlamaForCausalLM``.

Example::

    nohup python tools/train_eagle_head.py --minutes 10 > /tmp/eagle_train/train.log 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Must be set before OpenMP starts (see tools/train_demo_model.py: spin-waiting threads
# are several times slower on a shared CPU).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tools"))

import train_demo_model as demo  # noqa: E402  (the corpus pipeline)

TARGET_DIR = REPO_ROOT / "engine" / "assets" / "demo"
OUT_DIR = REPO_ROOT / "engine" / "assets" / "demo-eagle"
SEQ_LEN = demo.SEQ_LEN
MAX_ASSET_BYTES = 4_000_000


@dataclass(frozen=True)
class HeadSpec:
    """Optimisation settings of the head (architecture = one target decoder layer)."""

    lr: float = 2e-3
    batch: int = 8
    warmup_steps: int = 50
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    feature_weight: float = 1.0  # EAGLE: smooth-L1 regression of the next feature
    token_weight: float = 0.1  # EAGLE: w_cls, the token (distribution) loss
    init_std: float = 0.02


@dataclass
class TrainState:
    """Progress of one run (written into the model card)."""

    step: int = 0
    elapsed: float = 0.0  # seconds of training steps (excludes evaluation)
    tokens: int = 0
    threads: int = 0
    losses: list[float] = field(default_factory=list)
    agreements: list[float] = field(default_factory=list)  # training-batch top-1


def log(msg: str) -> None:
    """Print a timestamped line (the log is read while the job runs)."""
    print(time.strftime("%H:%M:%S"), msg, flush=True)


# --------------------------------------------------------------------------- data


@dataclass
class EagleData:
    """Token streams for the head, tokenized with the shipped demo tokenizer."""

    train: torch.Tensor  # int32 stream of training documents (+ synthetic chats)
    heldout: torch.Tensor  # int32 stream of the demo model's held-out documents
    versions: dict[str, str]


def encode_docs(tok: object, texts: list[str], add_bos: bool) -> list[list[int]]:
    """Token ids + EOS per text, exactly as ``train_demo_model.prepare_data`` encodes."""
    return [
        e.ids + [tok.eos_token_id]
        for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=add_bos)
    ]


def prepare_eagle_data(work: Path, seed: int) -> EagleData:
    """The demo model's corpus and held-out split, tokenized with the shipped tokenizer.

    ``train_demo_model.prepare_data`` retrains a tokenizer, whose ids need not match
    the shipped model's; so its pieces are reused here but tokenized with the
    tokenizer the target was actually trained and shipped with."""
    cache = work / "eagle_data.pt"
    if cache.exists():
        saved = torch.load(cache, weights_only=False)
        return EagleData(**saved)
    from transformers import AutoTokenizer

    root, versions = demo.fetch_packages(work)
    docs = demo.load_jargon(root) + demo.load_devil(root) + demo.load_pydoc(root)
    train_docs = [d for d in docs if not demo.is_heldout(d)]
    heldout_docs = [d for d in docs if demo.is_heldout(d)]
    tok = AutoTokenizer.from_pretrained(TARGET_DIR)
    rng = random.Random(seed)
    chats = demo.synthetic_chats(train_docs, tok, rng)
    pieces = [
        (d.source, ids)
        for d, ids in zip(train_docs, encode_docs(tok, [d.text for d in train_docs], True))
    ]
    pieces = [p for p in pieces for _ in range(demo.REPEATS[p[0]])]
    pieces += [("chat", ids) for ids in encode_docs(tok, chats, False)]
    rng.shuffle(pieces)
    stream = [i for _, ids in pieces for i in ids]
    heldout = [i for ids in encode_docs(tok, [d.text for d in heldout_docs], True) for i in ids]
    data = EagleData(
        train=torch.tensor(stream, dtype=torch.int32),
        heldout=torch.tensor(heldout, dtype=torch.int32),
        versions=versions,
    )
    torch.save(asdict(data), cache)
    log(f"data: {len(stream)} train tokens, {len(heldout)} held-out tokens "
        f"({len(heldout_docs)} docs)")
    return data


# --------------------------------------------------------------------------- models


def load_target() -> nn.Module:
    """The frozen demo model in float32 (transformers)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model


def head_config(target_config: object) -> object:
    """The target's LlamaConfig with one decoder layer: the head's shape."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**target_config.to_dict(), "num_hidden_layers": 1})
    cfg._attn_implementation = "sdpa"
    return cfg


class TrainHead(nn.Module):
    """The EAGLE-1 head in transformers modules, with the checkpoint's parameter names.

    ``fc`` mixes the next token's embedding with the target feature; one Llama decoder
    layer without its input norm; no final norm (the target's lm_head reads it)."""

    def __init__(self, config: object) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(1)])
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(
        self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """``[B, T, H]`` embeddings of t_{i+1} and features h_i -> predicted h_{i+1}."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        rope = self.rotary(x, positions)
        for layer in self.layers:  # attention_mask None + sdpa: causal
            x = layer(x, position_embeddings=rope, position_ids=positions)
        return x


def build_head(config: object, spec: HeadSpec, seed: int) -> TrainHead:
    """A freshly initialised head (normal(0, init_std) matrices, unit norms)."""
    torch.manual_seed(seed)
    head = TrainHead(config)
    for name, p in head.named_parameters():
        if p.ndim >= 2:
            nn.init.normal_(p, std=spec.init_std)
    return head


@dataclass
class TargetBatch:
    """What the frozen target says about a [B, L+1] token window."""

    features: torch.Tensor  # [B, L, H] final-normed hidden states h_0 .. h_{L-1}
    logits: torch.Tensor  # [B, L, V]


@torch.no_grad()
def run_target(target: nn.Module, tokens: torch.Tensor) -> TargetBatch:
    """Features and logits of the target at every position of ``tokens``."""
    features = target.model(input_ids=tokens).last_hidden_state
    return TargetBatch(features, target.lm_head(features))


@dataclass
class StepOutput:
    """Losses and the top-1 agreement of one batch."""

    loss: torch.Tensor
    feature_loss: float
    token_loss: float
    agreement: float
    compared: int


def head_step(
    head: TrainHead, target: nn.Module, tokens: torch.Tensor, spec: HeadSpec
) -> StepOutput:
    """EAGLE's objective on one window batch.

    Position i: input (embed(t_{i+1}), h_i); output vs h_{i+1} (smooth L1) and
    lm_head(output) vs softmax(target logits at i+1), which predict t_{i+2}."""
    tb = run_target(target, tokens)
    L = tokens.shape[1]
    with torch.no_grad():
        embeds = target.model.embed_tokens(tokens[:, 1:L])
    positions = torch.arange(L - 1).expand(tokens.shape[0], -1)
    out = head(embeds, tb.features[:, :-1], positions)
    feature_loss = F.smooth_l1_loss(out, tb.features[:, 1:])
    head_logits = target.lm_head(out)
    want = tb.logits[:, 1:]
    token_loss = -(want.softmax(-1) * head_logits.log_softmax(-1)).sum(-1).mean()
    loss = spec.feature_weight * feature_loss + spec.token_weight * token_loss
    agree = head_logits.argmax(-1) == want.argmax(-1)
    return StepOutput(
        loss, feature_loss.item(), token_loss.item(), agree.float().mean().item(), agree.numel()
    )


# --------------------------------------------------------------------------- training


def lr_at(spec: HeadSpec, state: TrainState, budget: float) -> float:
    """Linear warmup (steps), then cosine decay over the time budget."""
    if state.step < spec.warmup_steps:
        return spec.lr * (state.step + 1) / spec.warmup_steps
    progress = min(1.0, state.elapsed / budget)
    return spec.lr * (
        spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def make_optimizer(head: TrainHead, spec: HeadSpec) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms."""
    decay = [p for p in head.parameters() if p.ndim >= 2]
    no_decay = [p for p in head.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": spec.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=spec.lr,
        betas=(0.9, 0.95),
    )


def train(
    head: TrainHead,
    target: nn.Module,
    data: torch.Tensor,
    spec: HeadSpec,
    minutes: float,
    seed: int,
) -> TrainState:
    """Train ``head`` for ``minutes`` of step time on random windows of ``data``."""
    optim = make_optimizer(head, spec)
    gen = torch.Generator().manual_seed(seed + 1)
    state = TrainState(threads=torch.get_num_threads())
    budget = minutes * 60
    head.train()
    window_t, window_tok = time.time(), 0
    while state.elapsed < budget:
        t0 = time.time()
        for group in optim.param_groups:
            group["lr"] = lr_at(spec, state, budget)
        starts = torch.randint(0, len(data) - SEQ_LEN - 1, (spec.batch,), generator=gen)
        tokens = torch.stack([data[s : s + SEQ_LEN + 1] for s in starts.tolist()]).long()
        out = head_step(head, target, tokens, spec)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens += out.compared
        state.elapsed += time.time() - t0
        state.losses.append(round(out.loss.item(), 4))
        state.agreements.append(round(out.agreement, 4))
        window_tok += out.compared
        if state.step % 25 == 0:
            n = 25
            log(
                f"step {state.step} loss {sum(state.losses[-n:]) / n:.4f} "
                f"(feature {out.feature_loss:.4f}, token {out.token_loss:.3f}) "
                f"train top-1 {sum(state.agreements[-n:]) / n:.3f} "
                f"lr {optim.param_groups[0]['lr']:.2e} "
                f"{window_tok / (time.time() - window_t):.0f} tok/s "
                f"trained {state.elapsed / 60:.1f}/{minutes} min"
            )
            window_t, window_tok = time.time(), 0
    return state


def heldout_windows(heldout: torch.Tensor) -> torch.Tensor:
    """Non-overlapping [N, SEQ_LEN + 1] windows of the held-out stream."""
    n = (len(heldout) - 1) // SEQ_LEN
    return torch.stack([heldout[i * SEQ_LEN : (i + 1) * SEQ_LEN + 1] for i in range(n)]).long()


@torch.no_grad()
def heldout_agreement(
    head: TrainHead, target: nn.Module, heldout: torch.Tensor
) -> tuple[float, int]:
    """Top-1 agreement of head and target at every held-out position (teacher forced)."""
    head.eval()
    hits, count = 0.0, 0
    for batch in heldout_windows(heldout).split(16):
        out = head_step(head, target, batch, HeadSpec())
        hits += out.agreement * out.compared
        count += out.compared
    return hits / count, count


# --------------------------------------------------------------------------- export


def export_config() -> dict:
    """The demo model's config reshaped as a one-layer EAGLE head."""
    config = json.loads((TARGET_DIR / "config.json").read_text())
    config.update(
        architectures=["EagleLlamaForCausalLM"],
        num_hidden_layers=1,
        torch_dtype="bfloat16",
        dtype="bfloat16",
        bias=False,
        tie_word_embeddings=False,
    )
    return config


def export_tensors(head: TrainHead) -> dict[str, torch.Tensor]:
    """The EAGLE authors' layout: ``fc.weight``, ``layers.0.*``; no embedding, no lm_head."""
    return {
        name: p.detach().to(torch.bfloat16).contiguous()
        for name, p in head.state_dict().items()
        if name.startswith(("fc.", "layers."))
    }


def model_card(
    n_params: int, weight_bytes: int, agreement: float, compared: int, engine_agreement: float,
    state: TrainState, spec: HeadSpec, data: EagleData, command: str,
) -> str:
    """README.md of the exported head."""
    final = sum(state.agreements[-50:]) / max(1, len(state.agreements[-50:]))
    return f"""---
library_name: engine
tags: [eagle, speculative-decoding, llama, tiny, demo]
base_model: engine-demo (engine/assets/demo)
---

# engine demo-eagle: EAGLE-1 draft head for `demo`

A {n_params / 1e6:.2f}M parameter EAGLE-1 head (one Llama decoder layer without its
input norm, after `fc: [embedding; feature] 768 -> 384`, no final norm) that drafts
tokens for the tiny demo model in `engine/assets/demo` from its last (final-normed)
hidden states. The token embedding and the LM head are shared from the target and
are not stored here. Trained from scratch on CPU by `tools/train_eagle_head.py`.

| | |
|---|---|
| parameters | {n_params:,} (`fc` + one decoder layer) |
| weights | bfloat16 safetensors, {weight_bytes:,} bytes; EAGLE authors' names (`fc.weight`, \
`layers.0.*`) |
| shape | hidden 384, 6 query / 2 KV heads, head_dim 64, MLP 960, vocab 8192 (the target's) |
| engine class | `EagleLlamaForCausalLM` (`engine/model_executor/models/eagle_llama.py`) |

## Use

With the demo model as the target (vLLM's speculative-config keys):

```python
from engine import LLM
llm = LLM(speculative_config={{"method": "eagle", "model": "engine/assets/demo-eagle",
                               "num_speculative_tokens": 3}})
```

## Training

- Data: the demo model's corpus (`tools/train_demo_model.py`: Debian packages
  {", ".join(f"`{k}` {v}" for k, v in data.versions.items())} plus synthetic chats),
  tokenized with the demo tokenizer; {len(data.train):,} training-stream tokens.
- Objective (EAGLE): at position i the head reads (embed(t_(i+1)), h_i) from the frozen
  float32 target and is trained to regress h_(i+1) (smooth L1, weight {spec.feature_weight})
  and to match the target's next-token distribution at i+1 through the target's
  lm_head (soft cross-entropy, weight {spec.token_weight}).
- {state.step:,} steps of {spec.batch} x {SEQ_LEN} tokens ({state.tokens / 1e6:.2f}M positions),
  {state.elapsed / 60:.1f} minutes on {state.threads} CPU threads (float32),
  AdamW (0.9, 0.95), peak LR {spec.lr}, cosine decay over the time budget, weight decay
  {spec.weight_decay}. Final training top-1 agreement (last 50 steps): {final:.3f}.
- command: `{command}`

## Held-out agreement

Top-1 agreement of the head's argmax with the target's argmax for the token after
next (the acceptance proxy of the first drafted token, teacher forced), over
{compared:,} positions of the demo model's held-out documents (never trained on):

- **{agreement:.3f}** (float32 head, training script)
- **{engine_agreement:.3f}** (exported bf16 head loaded by the engine's
  `EagleLlamaForCausalLM`, target run by the engine, float32 compute)
"""


def write_asset(
    head: TrainHead, out: Path, agreement: float, compared: int, state: TrainState,
    spec: HeadSpec, data: EagleData, command: str,
) -> None:
    """Write config.json + model.safetensors, verify in the engine, then the model card."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(export_config(), indent=2, sort_keys=True) + "\n")
    tensors = export_tensors(head)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    engine_agreement, engine_count = engine_heldout_agreement(out, data.heldout)
    log(f"engine check: agreement {engine_agreement:.4f} over {engine_count} positions")
    n_params = sum(t.numel() for t in tensors.values())
    weight_bytes = (out / "model.safetensors").stat().st_size
    (out / "README.md").write_text(
        model_card(
            n_params, weight_bytes, agreement, compared, engine_agreement, state, spec, data,
            command,
        )
    )
    for path in out.iterdir():
        path.chmod(0o644)


# --------------------------------------------------------------------------- engine check


@dataclass
class EngineModels:
    """The demo target and the exported head as the engine builds them."""

    target: nn.Module
    head: nn.Module
    backend: object  # the CPU attention backend both were built with


def engine_prefill(models: EngineModels, num_layers: int, n: int, run: object) -> torch.Tensor:
    """``run()`` inside a forward context over a fresh paged cache for ``n`` tokens."""
    from engine.core.interfaces import AttentionBatch
    from engine.model_executor.forward_context import ForwardContext, set_forward_context

    backend, spec = models.backend, models.target.kv_cache_spec()
    bs = backend.block_size
    nblocks = -(-n // bs)
    shape = backend.get_kv_cache_shape(nblocks, bs, spec.num_kv_heads, spec.head_size)
    caches = [torch.zeros(shape) for _ in range(num_layers)]
    batch = AttentionBatch(
        num_reqs=1, num_tokens=n,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(nblocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(n), max_query_len=n, max_seq_len=n,
    )
    context = ForwardContext(backend.build_metadata(batch), caches)
    with torch.no_grad(), set_forward_context(context):
        return run()


def engine_models(head_dir: Path) -> EngineModels:
    """The demo target and the exported head, built and loaded by the engine (float32)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from engine.model_executor.models.interface import ModelInitContext
    from engine.model_executor.models.llama import LlamaForCausalLM
    from engine.model_executor.models.registry import MODEL_REGISTRY
    from engine.plugins.cpu.attention import CPUAttentionBackend

    backend = CPUAttentionBackend(block_size=16, device=torch.device("cpu"))
    ctx = ModelInitContext(dtype=torch.float32, device=torch.device("cpu"), attn_backend=backend)
    target = LlamaForCausalLM(AutoConfig.from_pretrained(TARGET_DIR), ctx).eval()
    target.load_weights(load_file(str(TARGET_DIR / "model.safetensors")).items())
    head_config = AutoConfig.from_pretrained(head_dir)
    head = MODEL_REGISTRY.resolve(head_config.architectures)(head_config, ctx).eval()
    head.load_weights(load_file(str(head_dir / "model.safetensors")).items())
    head.share_target(target)
    return EngineModels(target, head, backend)


def engine_heldout_agreement(head_dir: Path, heldout: torch.Tensor) -> tuple[float, int]:
    """The held-out agreement measured with the engine's modules instead of transformers."""
    models = engine_models(head_dir)
    target, head = models.target, models.head
    hits, count = 0, 0
    for window in heldout_windows(heldout):
        n = len(window)
        feats = engine_prefill(
            models, target.num_layers, n, lambda: target(window, torch.arange(n))
        )
        want = target.compute_logits(feats[1:]).argmax(-1)
        drafted = engine_prefill(
            models, head.num_layers, n - 1,
            lambda: head.compute_logits(head(window[1:], torch.arange(n - 1), feats[:-1])),
        ).argmax(-1)
        hits += int((drafted == want).sum())
        count += n - 1
    return hits / count, count


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/eagle_train"),
                   help="downloads, data cache, the trained head")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR, help="the exported head directory")
    p.add_argument("--minutes", type=float, default=10.0, help="training time budget")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=HeadSpec.lr)
    p.add_argument("--token-weight", type=float, default=HeadSpec.token_weight)
    p.add_argument("--export-only", action="store_true",
                   help="re-export the head saved in --work-dir by an earlier run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Prepare data, train, evaluate, export, verify."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.work_dir.resolve().is_relative_to(REPO_ROOT):
        raise SystemExit("--work-dir must be outside the repository")
    argv_used = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "tools/train_eagle_head.py"] + argv_used).replace(
        " --export-only", ""
    )
    spec = HeadSpec(lr=args.lr, token_weight=args.token_weight)
    data = prepare_eagle_data(args.work_dir, args.seed)
    target = load_target()
    head = build_head(head_config(target.config), spec, args.seed)
    saved = args.work_dir / "eagle_head.pt"
    if args.export_only:
        ckpt = torch.load(saved, weights_only=False)
        head.load_state_dict(ckpt["head"])
        state = TrainState(**ckpt["state"])
    else:
        n_params = sum(p.numel() for p in head.parameters())
        log(f"head: {n_params / 1e6:.2f}M parameters, budget {args.minutes} min, spec {spec}")
        state = train(head, target, data.train, spec, args.minutes, args.seed)
        torch.save({"head": head.state_dict(), "state": asdict(state)}, saved)
    agreement, compared = heldout_agreement(head, target, data.heldout)
    log(f"held-out top-1 agreement {agreement:.4f} over {compared} positions")
    write_asset(head, args.out_dir, agreement, compared, state, spec, data, command)
    size = demo.dir_bytes(args.out_dir)
    log(f"exported to {args.out_dir}: {size:,} bytes (limit {MAX_ASSET_BYTES:,})")
    if size > MAX_ASSET_BYTES:
        raise SystemExit("the head directory exceeds the size limit")


if __name__ == "__main__":
    main()
