"""`prepos train`: the bundled trend-reader model and its weak contrast, trained on the CPU.

A small Llama-architecture causal LM learns the market task (``prepos.lab.task.market``) from
conversations rendered by our own chat template: a system prompt, a few data messages (role
user), then either a question and its single-token answer, or the bare assistant header and
the trend (the question-independent decision point the engine pre-positions). The loss is
on the answer tokens, plus a lighter language-model loss on the price tokens, which teaches
the model that prices are ordered and move in runs. Two things make it fit in minutes on two
cores: each training row is one data prefix with several answer branches under a block
attention mask (the prefix is paid once for five answers), and the price embeddings start
from an ordered code of their value instead of from noise.

What it learns, held out: the trend at the bare header and after trend or wording-dependent
questions (~97%, median top-2 gap ~5.5). Polar questions (yes/no, negated, inverted) come
out in the right format but near the base rate: matching the asserted direction against the
data is an interaction this small recipe does not pick up in its step budget.

The same recipe, shrunk and stopped early, gives the *weak* model: it has learned the answer
format but does not read the task decisively, so its top-2 gaps stay small (the reference's
8B contrast). Both are saved as standard transformers directories (safetensors + tokenizer +
``gate.json``) and load through the same code path as any user's model.

Seeded and reproducible: the same arguments and thread count give the same weights.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from prepos.config import GateConfig
from prepos.lab.task.market import (
    ANSWERS,
    EVAL_SEED_BASE,
    PRICE_MAX,
    PRICE_MIN,
    TRENDS,
    Example,
    queries,
    sample_example,
)
from prepos.lab.task.tokenizer import IM_END
from prepos.lab.task.tokenizer import build as build_tokenizer

QUESTION_MIX = {"trend": 0.35, "polar": 0.45, "wording": 0.2}
DEFAULT_OUT = "models/trend-reader"
DEFAULT_WEAK_OUT = "models/trend-reader-weak"


@dataclass(frozen=True)
class Recipe:
    hidden: int = 112
    layers: int = 6  # depth matters more than width for reading a trend off prices
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 320
    steps: int = 800
    batch: int = 16  # rows; each row is one data prefix and 1 + `questions` answers
    lr: float = 3e-3
    warmup: int = 40
    weight_decay: float = 0.05
    lm_weight: float = 0.25  # LM loss on price tokens, relative to the answer loss
    eos_weight: float = 0.1  # loss on the <|im_end|> after the answer
    no_system_rate: float = 0.1  # conversations without a system message
    questions: int = 4  # question branches per data prefix (besides the bare header)
    ordinal_init: float = 0.05  # std of the ordered component of price embeddings (0: off)


# The weak contrast: the same recipe shrunk to one narrow layer and stopped early. It has
# learned the answer format, not the task, so its gaps stay far below any useful tau.
WEAK = Recipe(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, steps=100, lr=1e-3,
              warmup=10)


class Batcher:
    """Seeded stream of training rows.

    A row is one data prefix (system prompt and data messages, as the engine commits them)
    followed by several *branches*, each an entry plus its answer: the bare assistant header
    and the trend, then a few questions and their answers. A block attention mask lets every
    branch see the prefix and itself only, and its positions restart where the prefix ends,
    so each branch is exactly the conversation the engine would run; the prefix is paid once
    for all of them.
    """

    def __init__(self, tokenizer, seed: int, no_system_rate: float = 0.1, questions: int = 3,
                 mix: dict[str, float] | None = None):
        self.tok = tokenizer
        self.rng = random.Random(seed)
        self.no_system_rate = no_system_rate
        self.questions = questions
        self.mix = mix or QUESTION_MIX
        self.im_end = tokenizer.convert_tokens_to_ids(IM_END)
        self.pad = tokenizer.pad_token_id
        self.answer_ids = {a: tokenizer.encode(a, add_special_tokens=False)[0] for a in ANSWERS}
        # Price tokens (" 10" .. " 99") carry the LM loss on data.
        self.price_ids = torch.zeros(len(tokenizer) + 1, dtype=torch.bool)
        for p in range(PRICE_MIN, PRICE_MAX + 1):
            self.price_ids[tokenizer.encode(f" {p}", add_special_tokens=False)[0]] = True

    def render(self, chat: list[dict], generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(chat, add_generation_prompt=generation_prompt,
                                            tokenize=False)

    def encode(self, ex: Example, system: bool = True) -> tuple[list[int], int]:
        """One plain conversation: its ids through the answer and <|im_end|>, and the index
        of the answer token."""
        chat = ex.chat() if system else ex.chat()[1:]
        ids = self.tok.encode(self.render(chat, True), add_special_tokens=False)
        return ids + [self.answer_ids[ex.answer], self.im_end], len(ids)

    def row(self) -> tuple[list[int], list[tuple[list[int], int]]]:
        rng = self.rng
        ex = sample_example(rng, mix={"header": 1.0})
        chat = ex.chat() if rng.random() >= self.no_system_rate else ex.chat()[1:]
        base = self.render(chat)
        prefix = self.tok.encode(base, add_special_tokens=False)
        branches = []
        header = self.tok.encode(self.render(chat, True)[len(base):], add_special_tokens=False)
        branches.append((header + [self.answer_ids[ex.trend], self.im_end], len(header)))
        kinds = list(self.mix)
        for _ in range(self.questions):
            kind = rng.choices(kinds, [self.mix[k] for k in kinds])[0]
            q = rng.choice(queries(ex.ticker, ex.trend, (kind,)))
            text = self.render([*chat, {"role": "user", "content": q.text}], True)[len(base):]
            ids = self.tok.encode(text, add_special_tokens=False)
            branches.append((ids + [self.answer_ids[q.answer], self.im_end], len(ids)))
        return prefix, branches

    def batch(self, n: int) -> dict:
        rows = [self.row() for _ in range(n)]
        width = max(len(p) + sum(len(b) for b, _ in br) for p, br in rows)
        x = torch.full((n, width), self.pad, dtype=torch.long)
        pos = torch.zeros((n, width), dtype=torch.long)
        seg = torch.full((n, width), -1, dtype=torch.long)  # 0 prefix, k branch k, -1 pad
        answers, eos, lm = [], [], []
        for i, (prefix, branches) in enumerate(rows):
            lp = len(prefix)
            x[i, :lp] = torch.tensor(prefix)
            pos[i, :lp] = torch.arange(lp)
            seg[i, :lp] = 0
            at = lp
            for k, (ids, a) in enumerate(branches, start=1):
                x[i, at : at + len(ids)] = torch.tensor(ids)
                pos[i, at : at + len(ids)] = torch.arange(lp, lp + len(ids))
                seg[i, at : at + len(ids)] = k
                answers.append((i, at + a - 1, at + a))  # (row, predicting position, target)
                eos.append((i, at + a, at + a + 1))
                at += len(ids)
            for t in range(lp - 1):
                if self.price_ids[prefix[t + 1]]:
                    lm.append((i, t, t + 1))
        same = (seg.unsqueeze(2) == seg.unsqueeze(1)) | (seg.unsqueeze(1) == 0)
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        mask = same & causal & (seg.unsqueeze(1) >= 0)
        mask |= torch.eye(width, dtype=torch.bool)  # padding attends to itself
        return {
            "input_ids": x,
            "position_ids": pos,
            "attention_mask": mask.unsqueeze(1),
            "answers": torch.tensor(answers),
            "eos": torch.tensor(eos),
            "lm": torch.tensor(lm),
        }


def make_model(vocab: int, r: Recipe, tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=r.hidden,
        intermediate_size=r.intermediate,
        num_hidden_layers=r.layers,
        num_attention_heads=r.heads,
        num_key_value_heads=r.kv_heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    if r.ordinal_init:
        ordinal_price_init(model, tokenizer, r.ordinal_init, seed)
    return model


@torch.no_grad()
def ordinal_price_init(model, tokenizer, scale: float, seed: int, freqs: int = 8) -> None:
    """Give the price tokens an ordered start: add to each price's embedding a fixed random
    projection of smooth features of its value (the value itself and low-frequency
    sinusoids), so neighbouring prices start close and the level is linearly readable.
    Training is free to move them; it just does not have to discover the order of 90
    numbers from scratch."""
    emb = model.get_input_embeddings().weight
    g = torch.Generator().manual_seed(seed + 1)
    values = torch.arange(PRICE_MIN, PRICE_MAX + 1, dtype=torch.float32)
    v = (values - PRICE_MIN) / (PRICE_MAX - PRICE_MIN)
    feats = [v - 0.5]
    for f in range(1, freqs + 1):
        feats += [torch.cos(math.pi * f * v), torch.sin(math.pi * f * v)]
    phi = torch.stack(feats, dim=1)  # (90, 2 * freqs + 1)
    proj = torch.randn(phi.shape[1], emb.shape[1], generator=g) / math.sqrt(phi.shape[1])
    add = phi @ proj
    add *= scale / add.std()
    ids = [tokenizer.encode(f" {int(p)}", add_special_tokens=False)[0] for p in values]
    emb[ids] += add.to(emb.dtype)


def loss_fn(logits: torch.Tensor, batch: dict, r: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """Answer CE + eos CE + LM CE on price tokens (each a mean over its positions)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    x = batch["input_ids"]

    def ce(idx: torch.Tensor) -> torch.Tensor:
        rows, at, tgt = idx[:, 0], idx[:, 1], idx[:, 2]
        return -lp[rows, at, x[rows, tgt]].mean()

    ans = ce(batch["answers"])
    return ans + r.eos_weight * ce(batch["eos"]) + r.lm_weight * ce(batch["lm"]), ans


@torch.no_grad()
def evaluate(model, tokenizer, n: int = 256, seed: int = EVAL_SEED_BASE + 7) -> dict:
    """Held-out accuracy and top-2 gaps per decision kind: the bare header, and after a
    trend, polar or wording question."""
    was_training = model.training
    model.eval()
    b = Batcher(tokenizer, seed, 0.0)
    rng = random.Random(seed)
    kinds = ("header", "trend", "polar", "wording")
    stats: dict[str, list] = {k: [] for k in kinds}
    for _ in range(n):
        for key in kinds:
            ex = sample_example(rng, mix={key: 1.0})
            ids, p = b.encode(ex)
            logits = model(input_ids=torch.tensor([ids[:p]]), logits_to_keep=1).logits[0, -1]
            top = torch.topk(logits.float(), 2)
            stats[key].append((int(top.indices[0]) == ids[p], float(top.values[0] - top.values[1])))
    out = {}
    for key, rows in stats.items():
        gaps = sorted(g for _, g in rows)
        out[key] = {
            "accuracy": round(sum(c for c, _ in rows) / len(rows), 4),
            "gap_p10": round(gaps[len(gaps) // 10], 3),
            "gap_median": round(gaps[len(gaps) // 2], 3),
        }
    model.train(was_training)
    return out


def train_one(r: Recipe, tokenizer, seed: int, log_every: int = 50, name: str = "model",
              eval_every: int = 0):
    torch.manual_seed(seed)
    model = make_model(len(tokenizer), r, tokenizer, seed)
    model.train()
    b = Batcher(tokenizer, seed, r.no_system_rate, r.questions)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": r.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=r.lr,
        betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:
        if step < r.warmup:
            return r.lr * (step + 1) / r.warmup
        t = (step - r.warmup) / max(1, r.steps - r.warmup)
        return r.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))

    t0 = time.perf_counter()
    run_loss = run_ans = 0.0
    for step in range(r.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        batch = b.batch(r.batch)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=batch["attention_mask"]).logits
        loss, ans = loss_fn(logits, batch, r)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run_loss += float(loss.detach())
        run_ans += float(ans.detach())
        if (step + 1) % log_every == 0 or step + 1 == r.steps:
            k = (step % log_every) + 1
            print(
                f"[{name}] step {step + 1}/{r.steps} loss {run_loss / k:.3f} "
                f"answer {run_ans / k:.3f} ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
            run_loss = run_ans = 0.0
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < r.steps:
            held = json.dumps(evaluate(model, tokenizer, 64))
            print(f"[{name}] step {step + 1} held-out: {held}", flush=True)
    model.eval()
    return model, time.perf_counter() - t0


def save(model, tokenizer, out: Path, recipe: Recipe, metrics: dict, seconds: float, seed: int):
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    # the tokenizer files were written by build_tokenizer (chat_template inline)
    # An uncalibrated gate at the reference's coded tau; `prepos calibrate` overwrites it.
    GateConfig(tau=2.0, answers=ANSWERS).save(out / "gate.json")
    info = {
        "recipe": recipe.__dict__,
        "seed": seed,
        "train_seconds": round(seconds, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "held_out": metrics,
        "trends": list(TRENDS),
    }
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prepos train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="default model directory")
    ap.add_argument("--weak-out", default=DEFAULT_WEAK_OUT, help="weak model directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=Recipe.steps)
    ap.add_argument("--weak-steps", type=int, default=WEAK.steps)
    ap.add_argument("--batch", type=int, default=Recipe.batch)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads. 1 by default: on a shared 2-core machine a "
                         "second OpenMP thread that waits for a busy core made steps 5x slower")
    ap.add_argument("--vocab", type=int, default=1024, help="upper bound on the BPE vocabulary")
    ap.add_argument("--skip-default", action="store_true", help="train only the weak model")
    ap.add_argument("--skip-weak", action="store_true", help="train only the default model")
    ap.add_argument("--eval", type=int, default=256, help="held-out conversations to evaluate")
    ap.add_argument("--eval-every", type=int, default=0, help="also evaluate every N steps")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a field of the default model's recipe (experiments)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    t_all = time.perf_counter()
    jobs = []
    if not args.skip_default:
        over = {}
        for kv in args.set:
            k, v = kv.split("=", 1)
            over[k] = type(getattr(Recipe, k))(v)
        recipe = Recipe(**{**Recipe().__dict__, "steps": args.steps, "batch": args.batch, **over})
        jobs.append(("trend-reader", recipe, Path(args.out)))
    if not args.skip_weak:
        weak = Recipe(**{**WEAK.__dict__, "steps": args.weak_steps, "batch": args.batch})
        # (the weak model shares the batch size, so the two differ only in size and steps)
        jobs.append(("trend-reader-weak", weak, Path(args.weak_out)))
    for name, recipe, out in jobs:
        if out.exists():
            for f in ("model.safetensors", "config.json", "generation_config.json"):
                (out / f).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer = build_tokenizer(out, vocab_size=args.vocab, seed=args.seed)
        model, secs = train_one(recipe, tokenizer, args.seed, name=name,
                                eval_every=args.eval_every)
        metrics = evaluate(model, tokenizer, n=args.eval)
        print(f"[{name}] held-out: {json.dumps(metrics)}", flush=True)
        save(model, tokenizer, out, recipe, metrics, secs, args.seed)
        size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
        print(f"[{name}] saved to {out} ({size:.1f} MiB, {secs:.0f}s training)", flush=True)
    print(f"total {time.perf_counter() - t_all:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
