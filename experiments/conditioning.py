r"""The condition-number experiments of docs/conditioning.md (docs/method/papers.md §2, §3).

    OPENBLAS_NUM_THREADS=1 python experiments/conditioning.py [--parts=prop41,jacobian,width,embedding]

- jacobian: a small skipless ViT at initialization (d=64, 4 heads, 16 tokens, depth 4, no
  skips), default init vs the skipless init of docs/method/papers.md §3, 5 seeds, on Gaussian-noise images
  (16×16×3, patch 4) and on the digits quickstart model: per layer log κ(K_ℓ), log κ(B_ℓ),
  ‖K−B‖/‖K‖ and log κ of the whole block, all float64.
- width: one attention layer at LayerNorm-scaled Gaussian tokens (n=16), head dim 32 and 64, d up
  to 192, default vs skipless init, 3 seeds: does κ(K) approach κ(B) as the width grows?
- embedding: the quickstart on digits with both skips and without the SAB skip, 3 seeds, at
  initialization and after training: per-layer log κ of ①, ①+②, ③, ③+④ (64 test images).
- prop41: Prop. 4.1 of "Always Skip Attention": log κ of linear attention vs linear FFN outputs
  against log κ of the input, with the bounds.

Results are cached in `docs/figures/conditioning.json` (a rerun skips what is there; delete
entries or pass --fresh to recompute); figures go to `docs/figures/conditioning_*.png` and the
tables to stdout as Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
FIGURES = os.path.join(ROOT, "docs", "figures")

# name -> (init, alpha, beta, c); the skipless constants are those of configs/quickstart.py.
INITS = {
    "default": ("default", 1.0, 1.0, 1.0),
    "skipless (α=2, β=0.6, c=3)": ("skipless", 2.0, 0.6, 3.0),
    "skipless (α=1.8, β=1, c=3)": ("skipless", 1.8, 1.0, 3.0),
}
EMBEDDING_VARIANTS = {
    "both skips": "skip_sab=True,skip_ffn=True",
    "no SAB skip": "skip_sab=False,skip_ffn=True",
}
PAPER = {"paper ① ≈ 6": 6.0, "paper ③ ≈ 3": 3.0}


def load_config(name: str, arg: str | None = None) -> Any:
    """configs/<name>.py's get_config(arg), the file loaded as the sweep loads it."""
    from skipless_jax import sweep

    return sweep.load_config_module(os.path.join(ROOT, "configs", f"{name}.py")).get_config(arg)


# ------------------------------------------------------------------ Jacobians


def jacobian_at_init(setting: str, init_name: str, seed: int) -> list[dict[str, float]]:
    """Per-layer Jacobian report for one (input setting, init, seed), at initialization."""
    import jax
    import jax.numpy as jnp

    from skipless_jax import analyze
    from skipless_jax.models import vit

    scheme, alpha, beta, c = INITS[init_name]
    if setting == "noise":
        model = vit.ViT(
            num_classes=10, patch_size=4, width=64, depth=4, mlp_dim=128, num_heads=4,
            skip_sab=False, skip_ffn=False, pool="gap", init_scheme=scheme,
            init_alpha=alpha, init_beta=beta, init_c=c,
        )
        images = np.asarray(jax.random.normal(jax.random.key(1000 + seed), (1, 16, 16, 3)))
        params = model.init({"params": jax.random.key(seed)}, jnp.zeros((1, 16, 16, 3)))["params"]
    else:  # the digits quickstart model without skips, on test image `seed`
        config = load_config("quickstart", f"skip_sab=False,skip_ffn=False,init={scheme},seed={seed}")
        config.model.update(init_alpha=alpha, init_beta=beta, init_c=c)
        model, shape = analyze.build(config)
        params = analyze.init_params(model, config, shape)
        images = analyze.probe_images(config, seed + 1)[seed:]
    return analyze.jacobian_rows(model, params, images)


def run_jacobians(results: dict[str, Any], seeds: list[int]) -> None:
    table = results.setdefault("jacobian", {})
    for setting in ("noise", "digits"):
        for init_name in INITS:
            for seed in seeds:
                key = f"{setting}|{init_name}|{seed}"
                if key not in table:
                    table[key] = jacobian_at_init(setting, init_name, seed)
                    print(key, [round(r["log_kappa_K"], 2) for r in table[key]], flush=True)
                    save(results)


def _ms(a: np.ndarray) -> str:
    return f"{a.mean():.1f} ± {a.std():.1f}"


def summarize_jacobians(results: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = results["jacobian"]
    lines = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, setting in zip(axes, ("noise", "digits")):
        lines += [
            f"\n**{setting}** (mean ± std over seeds; natural log)\n",
            "| init | layer | log κ(K_ℓ) | log κ(B_ℓ) | log κ(K) − log κ(B) | ‖K−B‖/‖K‖ | log κ(block) |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, init_name in enumerate(INITS):
            runs = [v for k, v in table.items() if k.startswith(f"{setting}|{init_name}|")]
            if not runs:
                continue
            k, b, diff, block = (np.array([[row[f] for row in run] for run in runs])  # (seeds, L)
                                 for f in ("log_kappa_K", "log_kappa_B", "rel_diff_K_B", "log_kappa_block"))
            for layer in range(k.shape[1]):
                k_l, b_l, block_l = k[:, layer], b[:, layer], block[:, layer]
                lines.append(f"| {init_name} | {layer} | {_ms(k_l)} | {_ms(b_l)} | {_ms(k_l - b_l)} | "
                             f"{diff[:, layer].mean():.2f} | {_ms(block_l)} |")
            layers = np.arange(k.shape[1])
            color = f"C{i}"
            ax.errorbar(layers, k.mean(0), k.std(0), color=color, marker="o", capsize=3,
                        label=f"{init_name}: κ(K_ℓ)")
            ax.plot(layers, b.mean(0), color=color, linestyle="--", marker="x", label=f"{init_name}: κ(B_ℓ)")
        ax.set_title({"noise": "Gaussian-noise images (16×16×3, patch 4)",
                      "digits": "digits test images (quickstart model, patch 2)"}[setting], fontsize=10)
        ax.set_xlabel("layer (block index)")
        ax.set_xticks(layers)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("log κ (natural log)")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"Attention Jacobian K_ℓ = ∂SA/∂X vs B_ℓ = Σ_h A_h ⊗ (WⱽWᴼ)_hᵀ, skipless ViT at init "
                 f"(d=64, h=4, n=16, L=4), {len(runs)} seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(FIGURES, "conditioning_jacobian.png"), dpi=120)
    plt.close(fig)
    return "\n".join(lines)


WIDTHS = {32: (32, 64, 128, 192), 64: (64, 128, 192)}  # head dim -> widths (192 = ViT-Ti)


def run_width(results: dict[str, Any], seeds: list[int]) -> None:
    """One attention layer at LayerNorm-scaled Gaussian tokens (n=16): K_ℓ vs B_ℓ against width."""
    import jax
    import jax.numpy as jnp

    from skipless_jax import conditioning
    from skipless_jax.models import vit

    table = results.setdefault("width", {})
    for head_dim, widths in WIDTHS.items():
        for d in widths:
            for init_name in ("default", "skipless (α=2, β=0.6, c=3)"):
                scheme, alpha, beta, c = INITS[init_name]
                for seed in seeds:
                    key = f"{head_dim}|{d}|{init_name}|{seed}"
                    if key in table:
                        continue
                    x = np.asarray(jax.random.normal(jax.random.key(1000 + seed), (16, d)), np.float64)
                    x = (x - x.mean(1, keepdims=True)) / x.std(1, keepdims=True)  # LN1 output at init
                    attn = vit.MultiHeadAttention(d // head_dim, scheme, alpha, beta, c)
                    params = attn.init({"params": jax.random.key(seed)}, jnp.zeros((1, 16, d)))["params"]
                    table[key] = conditioning.compare_attention_jacobian(params, x, d // head_dim)
                    print(key, {k: round(v, 2) for k, v in table[key].items()}, flush=True)
                    save(results)


def summarize_width(results: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = results["width"]
    lines = ["| head dim | d (heads) | init | log κ(K) | log κ(B) | log κ(K) − log κ(B) | ‖K−B‖/‖K‖ |",
             "|---|---|---|---|---|---|---|"]
    fig, axes = plt.subplots(1, len(WIDTHS), figsize=(12, 4.5), sharey=True)
    for ax, (head_dim, widths) in zip(axes, WIDTHS.items()):
        for i, init_name in enumerate(("default", "skipless (α=2, β=0.6, c=3)")):
            k_mean, b_mean = [], []
            for d in widths:
                runs = [v for key, v in table.items() if key.startswith(f"{head_dim}|{d}|{init_name}|")]
                k = np.array([r["log_kappa_K"] for r in runs])
                b = np.array([r["log_kappa_B"] for r in runs])
                rel = np.mean([r["rel_diff_K_B"] for r in runs])
                lines.append(f"| {head_dim} | {d} ({d // head_dim}) | {init_name} | {k.mean():.1f} ± {k.std():.1f} | "
                             f"{b.mean():.1f} ± {b.std():.1f} | {(k - b).mean():.1f} | {rel:.2f} |")
                k_mean.append(k.mean())
                b_mean.append(b.mean())
            ax.plot(widths, k_mean, marker="o", color=f"C{i}", label=f"{init_name}: κ(K)")
            ax.plot(widths, b_mean, marker="x", linestyle="--", color=f"C{i}", label=f"{init_name}: κ(B)")
        ax.set_xlabel(f"width d (head dim {head_dim}, n = 16 tokens)")
        ax.set_xticks(widths)
        ax.set_title(f"head dim {head_dim}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("log κ (natural log), mean over seeds")
    axes[0].legend(fontsize=8)
    fig.suptitle("One attention layer at LayerNorm-scaled Gaussian tokens: κ(K) vs κ(B) against width", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(FIGURES, "conditioning_width.png"), dpi=120)
    plt.close(fig)
    return "\n".join(lines)


# ------------------------------------------------------------------ embeddings


def run_embeddings(results: dict[str, Any], seeds: list[int], num_images: int = 64) -> None:
    from skipless_jax import analyze
    from skipless_jax.trainers import supervised

    table = results.setdefault("embedding", {})
    for name, arg in EMBEDDING_VARIANTS.items():
        for seed in seeds:
            key = f"{name}|{seed}"
            if key in table:
                continue
            # The standard recipe these figures were made with (the quickstart's default is now skipless + SOAP).
            config = load_config("quickstart", f"init=default,opt=adamw,{arg},seed={seed}")
            config.checkpoint_every_steps = 0  # the final step is still saved
            model, shape = analyze.build(config)
            images = analyze.probe_images(config, num_images)
            entry = {"init": analyze.embedding_kappa(model, analyze.init_params(model, config, shape), images)}
            with tempfile.TemporaryDirectory() as workdir:
                metrics = supervised.train_and_evaluate(config, workdir)
                params, step, source = analyze.load_params(model, config, shape, workdir)
            assert source == "checkpoint", source
            entry["trained"] = analyze.embedding_kappa(model, params, images)
            table[key] = {
                "test_accuracy": metrics["test_accuracy"], "step": step,
                **{when: {p: v.tolist() for p, v in entry[when].items()} for when in ("init", "trained")},
            }
            print(key, f"acc={metrics['test_accuracy']:.4f}",
                  {w: np.round(table[key][w]["sab"], 2).tolist() for w in ("init", "trained")}, flush=True)
            save(results)


def summarize_embeddings(results: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from skipless_jax import analyze, conditioning

    table = results["embedding"]
    lines = ["| variant | when | test acc. (%) | layer | ① | ①+② | ③ | ③+④ |", "|---|---|---|---|---|---|---|---|"]
    for name in EMBEDDING_VARIANTS:
        runs = [v for k, v in table.items() if k.startswith(f"{name}|")]
        if not runs:
            continue
        acc = np.array([r["test_accuracy"] for r in runs]) * 100
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for ax, when in zip(axes, ("init", "trained")):
            mean = {p: np.mean([r[when][p] for r in runs], axis=0) for p in conditioning.EMBEDDING_POINTS}
            std = {p: np.std([r[when][p] for r in runs], axis=0) for p in conditioning.EMBEDDING_POINTS}
            for layer in range(len(mean["sab"])):
                lines.append(
                    f"| {name} | {when} | {acc.mean():.1f} ± {acc.std():.1f} | {layer} | "
                    + " | ".join(f"{mean[p][layer]:.2f} ± {std[p][layer]:.2f}" for p in conditioning.EMBEDDING_POINTS)
                    + " |"
                )
            unused = analyze.unused_points(dict(skip_sab=name != "no SAB skip", skip_ffn=True))
            for p in conditioning.EMBEDDING_POINTS:
                style = dict(linestyle=":", alpha=0.6) if p in unused else {}
                ax.errorbar(np.arange(len(mean[p])), mean[p], std[p], marker="o", capsize=3,
                            label=conditioning.POINT_LABELS[p] + (" (not in the model)" if p in unused else ""),
                            **style)
            for label, value in PAPER.items():
                ax.axhline(value, color="gray", linestyle="--", linewidth=1)
                ax.annotate(label, (1.0, value), xycoords=("axes fraction", "data"), textcoords="offset points",
                            xytext=(-4, 3), ha="right", fontsize=8, color="gray")
            ax.set_title({"init": "at initialization",
                          "trained": f"after training (40 epochs, test acc. {acc.mean():.1f}%)"}[when], fontsize=10)
            ax.set_xlabel("layer (block index)")
            ax.set_xticks(np.arange(len(mean["sab"])))
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("log κ of the token matrix (natural log)")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"configs/quickstart.py:{EMBEDDING_VARIANTS[name]} (digits, d=64, L=4, h=4, default init): "
                     f"{name}, mean ± std over {len(runs)} seeds, 64 test images", fontsize=10)
        fig.tight_layout()
        fig.savefig(os.path.join(FIGURES, f"conditioning_embedding_{name.replace(' ', '_').lower()}.png"), dpi=120)
        plt.close(fig)
    return "\n".join(lines)


# ------------------------------------------------------------------ Prop. 4.1


def run_prop41(results: dict[str, Any], seeds: list[int]) -> None:
    import jax

    from skipless_jax import conditioning
    from skipless_jax.models import init

    if "prop41" in results:
        return
    n, d, rows = 32, 16, []
    shapes = [(d, d), (d, d), (d, d), (d, 4 * d), (4 * d, d)]
    for weights in ("orthogonal", "gaussian"):
        for seed in seeds:
            for log_kappa in np.linspace(0.0, 4.0, 9):
                ks = jax.random.split(jax.random.key(seed * 100 + int(log_kappa * 10)), 6)
                x = conditioning.matrix_with_log_kappa(ks[0], n, d, float(log_kappa))
                if weights == "orthogonal":  # κ(W) = 1: the bound is exactly 3·log κ(X)
                    w = [np.asarray(init.haar_orthogonal(k, s), np.float64) for k, s in zip(ks[1:], shapes)]
                else:
                    w = [np.asarray(jax.random.normal(k, s), np.float64) / np.sqrt(s[0])
                         for k, s in zip(ks[1:], shapes)]
                rows.append({"seed": seed, "weights": weights, **conditioning.cube_bound_check(x, *w)})
    results["prop41"] = rows
    save(results)


def summarize_prop41(results: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["prop41"]
    get = lambda f, kind=None: np.array([r[f] for r in rows if kind in (None, r["weights"])])
    held = bool(np.all(get("attn") <= get("attn_bound") + 1e-9) and np.all(get("ffn") <= get("ffn_bound") + 1e-9))
    fig, ax = plt.subplots(figsize=(7, 4.8))
    text = [f"Prop. 4.1 over {len(rows)} (X, W) draws (n=32, d=16): the bounds hold in every draw: {held}."]
    for kind, fill in (("orthogonal", None), ("gaussian", "none")):
        x = get("x", kind)
        # Subtract the weights' constant so both families share the bound lines 3x and x.
        attn = get("attn", kind) - (get("attn_bound", kind) - 3 * x)
        ffn = get("ffn", kind) - (get("ffn_bound", kind) - x)
        s_attn, s_ffn = np.polyfit(x, attn, 1)[0], np.polyfit(x, ffn, 1)[0]
        text.append(f"{kind} weights: least-squares slope of log κ(out) − log C on log κ(X): "
                    f"attention {s_attn:.2f}, FFN {s_ffn:.2f}.")
        ax.scatter(x, attn, s=16, color="C0", facecolors=fill,
                   label=f"attention X WᵠWᴷᵀ Xᵀ X Wⱽ, {kind} W (slope {s_attn:.2f})")
        ax.scatter(x, ffn, s=16, marker="^", color="C1", facecolors=fill,
                   label=f"FFN X W_up W_down, {kind} W (slope {s_ffn:.2f})")
    grid = np.linspace(0, 4, 10)
    ax.plot(grid, 3 * grid, "k--", linewidth=1, label="bound 3·log κ(X) (attention)")
    ax.plot(grid, grid, "k:", linewidth=1, label="bound log κ(X) (FFN)")
    ax.set_xlabel("log κ(X) of the input")
    ax.set_ylabel("log κ(output) − log C(weights)")
    ax.set_title("Prop. 4.1 (Always Skip Attention): κ(linear attention) ≤ C·κ(X)³, κ(FFN) ≤ C·κ(X)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(FIGURES, "conditioning_prop41.png"), dpi=120)
    plt.close(fig)
    return "\n".join(text)


# ------------------------------------------------------------------ driver

RESULTS = os.path.join(FIGURES, "conditioning.json")


def save(results: dict[str, Any]) -> None:
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="prop41,jacobian,width,embedding")
    parser.add_argument("--fresh", action="store_true", help="ignore cached results")
    args = parser.parse_args()
    os.makedirs(FIGURES, exist_ok=True)
    results = {}
    if not args.fresh and os.path.exists(RESULTS):
        with open(RESULTS) as f:
            results = json.load(f)
    parts = args.parts.split(",")
    unknown = set(parts) - {"jacobian", "width", "embedding", "prop41"}
    if unknown:
        raise SystemExit(f"error: --parts has unknown {sorted(unknown)}; allowed: prop41, jacobian, width, embedding")
    if "prop41" in parts:
        run_prop41(results, seeds=list(range(5)))
        print(summarize_prop41(results))
    if "jacobian" in parts:
        run_jacobians(results, seeds=list(range(5)))
        print(summarize_jacobians(results))
    if "width" in parts:
        run_width(results, seeds=list(range(3)))
        print(summarize_width(results))
    if "embedding" in parts:
        run_embeddings(results, seeds=list(range(3)))
        print(summarize_embeddings(results))


if __name__ == "__main__":
    main()
