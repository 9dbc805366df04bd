"""Train the embedded default model (pipeline/assets/dsv3-tiny-pydoc) on CPU.

The architecture is DeepSeek-V3's, built by pipeline.model (the same code the project serves and
quantizes): MLA with the real widths (kv_lora_rank 512, qk_rope_head_dim 64), one dense layer then MoE
layers with the noaux_tc router (aux-loss-free balancing through e_score_correction_bias), and one MTP
layer trained with the next-next-token loss (weight 0.3). The MTP layer shares the main embedding and
head during training, as in DeepSeek-V3; the checkpoint stores copies, as the release does.

Text: pipeline.text.corpus (CPython's documentation topics and stdlib docstrings, plus chat-formatted
question/answer samples from the same documents); the held-out split is never trained on.

    python scripts/train_embedded.py --steps 1500 --out pipeline/assets/dsv3-tiny-pydoc

With ``--init DIR`` it fine-tunes the checkpoint in DIR instead (its tokenizer, held-out split and
calibration texts are copied to --out); with ``--plant-channels K`` it first plants massive activations in
K channels of the residual stream (scripts/residual_outliers.py) and fine-tunes until the held-out
perplexity (on the first --eval-tokens tokens, checked every --eval-every steps) is within --recover-pct of
the source's, at most --steps steps:

    python scripts/train_embedded.py --init pipeline/assets/dsv3-tiny-pydoc --out /tmp/rv-s1 \
        --plant-channels 2 --plant-factor-log2 5..6 --plant-seed 1 --steps 200 --lr 1e-3 --warmup 5 \
        --batch 8 --eval-every 10 --recover-pct 2

Writes model.safetensors (bf16), config.json and training_report.json (held-out perplexity) next to the
tokenizer files that scripts/train_tokenizer.py wrote.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.text import corpus  # noqa: E402
from pipeline.config import DeepseekV3Config  # noqa: E402
from pipeline.assets import EMBEDDED_CONFIG, EMBEDDED_MODEL_DIR  # noqa: E402
from pipeline.model import DeepseekV3ForCausalLM, build_model  # noqa: E402
from pipeline.model.ffn import MoE  # noqa: E402
from pipeline.model.perplexity import perplexity, token_stream  # noqa: E402
from pipeline.text.tokenizer import Tokenizer  # noqa: E402


def init_weights(model: DeepseekV3ForCausalLM, std: float) -> None:
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.normal_(p, std=std)
    # residual-output projections scaled down with depth (GPT-2 style) for a stable start
    n = model.config.num_hidden_layers + model.config.num_nextn_predict_layers
    for name, p in model.named_parameters():
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            p.data.mul_(1 / math.sqrt(2 * n))


def tie_mtp(model: DeepseekV3ForCausalLM) -> None:
    for layer in model.mtp_layers:
        layer.embed_tokens.weight = model.model.embed_tokens.weight
        layer.shared_head.head.weight = model.lm_head.weight


def balance_router(model: DeepseekV3ForCausalLM, rate: float) -> None:
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded."""
    for mod in model.modules():
        if isinstance(mod, MoE) and mod.last_load is not None:
            load = mod.last_load.float()
            mod.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


def losses(model: DeepseekV3ForCausalLM, batch: torch.Tensor, mtp_weight: float):
    x = batch[:, :-1]
    logits, h = model(x, return_hidden=True)
    main = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    if not model.mtp_layers or mtp_weight == 0:
        return main, torch.zeros(())
    mlogits, _ = model.mtp(h[:, :-1], batch[:, 1:-1])
    mtp = F.cross_entropy(mlogits.flatten(0, 1), batch[:, 2:].flatten())
    return main, mtp


def save(model: DeepseekV3ForCausalLM, out: Path, cfg_dict: dict) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    tensors = {k: (v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)) for k, v in state.items()}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")


INIT_FILES = ("tokenizer.json", "tokenizer_config.json", "heldout.json", "calib.json", "corpus_fingerprint.json")


def copy_init_files(src: Path, out: Path) -> dict:
    """--init: the source's tokenizer, held-out split and calibration texts into ``out``; its config."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    for f in INIT_FILES:
        if (src / f).exists():
            shutil.copyfile(src / f, out / f)
    return json.loads((src / "config.json").read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=EMBEDDED_MODEL_DIR)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--balance-rate", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--init", default=None, help="fine-tune this checkpoint instead of training from scratch")
    ap.add_argument("--plant-channels", type=int, default=0, help="with --init: residual channels to plant")
    ap.add_argument("--plant-factor-log2", default="5..6", help="each planted offset: 2^lo..2^hi residual RMS")
    ap.add_argument("--plant-seed", type=int, default=1)
    ap.add_argument("--plant-tokens", type=int, default=3, help="the most frequent token ids that carry them")
    ap.add_argument("--recover-pct", type=float, default=None,
                    help="with --init: stop once held-out perplexity is within this many %% of the source's")
    ap.add_argument("--eval-tokens", type=int, default=None, help="held-out tokens each evaluation reads")
    args = ap.parse_args(argv)
    if args.init is None and (args.plant_channels or args.recover_pct is not None):
        raise SystemExit("--plant-channels / --recover-pct: give --init (the checkpoint to fine-tune)")

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    cfg_dict = EMBEDDED_CONFIG
    if args.init:
        cfg_dict = copy_init_files(Path(args.init), out)
    tok = Tokenizer.from_dir(str(out))
    cfg = DeepseekV3Config.from_dict(cfg_dict)
    if tok.vocab_size != cfg.vocab_size:
        raise SystemExit(f"tokenizer vocab {tok.vocab_size} != config vocab_size {cfg.vocab_size}")

    train_docs, _ = corpus.split(corpus.documents())
    _, held_docs = corpus.load_heldout(str(out))     # the shipped split (identical on the recorded Python)
    train_texts = [d.text for d in train_docs] + corpus.chat_samples(train_docs)
    random.Random(args.seed).shuffle(train_texts)
    train = token_stream(tok, train_texts)
    held = token_stream(tok, [d.text for d in held_docs])
    print(f"train tokens {len(train):,}  held-out tokens {len(held):,}", flush=True)

    if args.init:
        from safetensors.torch import load_file

        model = build_model(cfg, load_file(str(Path(args.init) / "model.safetensors")), dtype=torch.float32)
    else:
        model = DeepseekV3ForCausalLM(cfg, dtype=torch.float32)
        init_weights(model, cfg.extra.get("initializer_range", 0.02))
    tie_mtp(model)
    held_eval = held[: args.eval_tokens] if args.eval_tokens else held
    source_eval = perplexity(model, held_eval, args.seq) if args.init else None
    planted = None
    if args.plant_channels:
        from residual_outliers import freeze_channels, outlier_ratio, plant

        lo, _, hi = args.plant_factor_log2.partition("..")
        probe = torch.stack([train[s: s + args.seq + 2] for s in range(0, 8 * args.seq, args.seq)])
        planted = plant(model, probe, args.plant_channels, (int(lo), int(hi or lo)), args.plant_seed,
                        args.plant_tokens)
        freeze_channels(model, planted["channels"], planted["token_ids"])
        planted["planted_heldout"] = perplexity(model, held_eval, args.seq)
        print(f"planted {planted}; source held-out {source_eval}", flush=True)
    model.train()
    params = [p for p in model.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    gen = torch.Generator().manual_seed(args.seed)
    history = []
    t0 = time.time()
    for step in range(args.steps):
        starts = torch.randint(0, len(train) - args.seq - 2, (args.batch,), generator=gen)
        batch = torch.stack([train[s: s + args.seq + 2] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        main_loss, mtp_loss = losses(model, batch, args.mtp_weight)
        loss = main_loss + args.mtp_weight * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            balance_router(model, args.balance_rate)
        if step % 25 == 0 or step == args.steps - 1:
            el = time.time() - t0
            print(f"step {step:5d}  loss {main_loss.item():.3f}  mtp {mtp_loss.item():.3f}  lr {lr_at(step):.2e}"
                  f"  {el / (step + 1):.2f}s/step  elapsed {el / 60:.1f} min", flush=True)
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            ev = perplexity(model, held_eval, args.seq)
            history.append({"step": step + 1, **ev})
            print(f"  held-out: {ev}", flush=True)
            save(model, out, cfg_dict)
            if args.recover_pct is not None and \
                    ev["perplexity"] <= source_eval["perplexity"] * (1 + args.recover_pct / 100):
                break

    # The shipped numbers: reload the bf16 checkpoint as a user would, evaluate in float32.
    from safetensors.torch import load_file

    shipped = build_model(cfg, load_file(str(out / "model.safetensors")), dtype=torch.float32)
    final = perplexity(shipped, held, args.seq)
    report = {
        "python_version": sys.version.split()[0],
        "torch_version": torch.__version__,
        "args": vars(args),
        "train_tokens": len(train),
        "heldout_tokens": len(held),
        "train_minutes": round((time.time() - t0) / 60, 1),
        "heldout_eval_seq": args.seq,
        "final_heldout_bf16_weights": final,
        "history_fp32_weights": history,
    }
    if args.init:
        report.update({"init": args.init, "steps_run": history[-1]["step"] if history else 0,
                       "source_heldout_eval": source_eval})
    if planted:
        planted["outlier_ratio"] = outlier_ratio(shipped, probe, planted["channels"])
        report["planted"] = planted
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["final_heldout_bf16_weights"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
