r"""Token Graying experiments behind docs/token_graying.md.

    OPENBLAS_NUM_THREADS=1 python experiments/token_graying.py --part=photos  # ~1 min
    OPENBLAS_NUM_THREADS=1 python experiments/token_graying.py --part=digits  # 15 runs, ~10 min

photos: on real photo patches (scikit-learn's china.jpg and flower.jpg), how closely DCT-TG
  follows SVD-TG (log κ reduction per ε, distance between outputs), how accurate the fast
  SVD-TG is, and the error of every TG in bf16 against float32. Writes
  docs/figures/token_graying_{kappa,spectrum,bf16}.png and docs/figures/token_graying_photos.json.
digits: the paper's ε ablation (ε = 1 (no TG), 0.9, 0.7, 0.6, 0.5 with SVD-TG; 3 seeds) with the
  quickstart config; per run the test accuracy and, on all 360 test images, the mean log κ of
  the token matrix after TG (κ_in) and of the patch-embedding output, the latter over its rank
  (X·W + b has at most d_in + 1 = 5 nonzero singular values for 2×2 patches). The runs are
  configs/quickstart.py's named grid `tg_eps`, trained with `python -m skipless_jax.sweep`'s
  runner into kept folders under --root (default docs/figures/token_graying_digits_runs/,
  git-ignored; a rerun resumes), `--config.*` overrides passed to every run; then
  docs/figures/token_graying_digits.json is written from the finished runs (--out) and
  docs/figures/token_graying_digits.png is drawn.
Both print the markdown tables that docs/token_graying.md shows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from skipless_jax import sweep  # noqa: E402  (the checkout's package, ROOT on the path first)

FIGURES = os.path.join(ROOT, "docs", "figures")
EPS_GRID = (0.95, 0.9, 0.7, 0.6, 0.5)
ABLATION_EPS = (1.0, 0.9, 0.7, 0.6, 0.5)
STANDARD = "skip_sab=True,skip_ffn=True,init=default,opt=adamw"
# Always Skip Attention, ε ablation (ViT-B, ImageNet, SVD-TG): top-1 and log κ_in (docs/method/papers.md §4).
PAPER_TOP1 = {1.0: 81.0, 0.9: 81.2, 0.7: 81.4, 0.6: 81.4, 0.5: 81.0}
PAPER_LOG_KAPPA_IN = {1.0: 6.72, 0.9: 6.64, 0.7: 6.15, 0.6: 5.73, 0.5: 5.29}


def log_kappa(x, rank: int | None = None) -> np.ndarray:
    """Natural log of σ_1/σ_r per matrix, r = `rank` (default: all min(n, d) singular values)."""
    s = np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)
    return np.log(s[..., 0]) - np.log(s[..., (rank or s.shape[-1]) - 1])


def _sv(x) -> np.ndarray:
    return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


def _log_normalized_sv(x) -> np.ndarray:
    s = _sv(x)
    return np.log(s / s[..., :1])


def rel(a, b) -> np.ndarray:
    """Per-matrix ‖a − b‖_F / ‖b‖_F over the last two axes."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=(-2, -1)) / np.linalg.norm(b, axis=(-2, -1))


def photo_sets() -> dict[str, np.ndarray]:
    """{'p=16, 224²': (N, 196, 768), 'p=4, 32²': (N, 64, 48)} patch matrices on a crop grid."""
    import jax.numpy as jnp
    from sklearn.datasets import load_sample_images

    from skipless_jax.models import vit

    photos = [im.astype(np.float32) / 127.5 - 1.0 for im in load_sample_images().images]
    small = [
        im[: im.shape[0] // 4 * 4, : im.shape[1] // 4 * 4]
        .reshape(im.shape[0] // 4, 4, im.shape[1] // 4, 4, 3)
        .mean((1, 3))
        for im in photos
    ]
    sets = {}
    for name, images, size, p, stride in [("p=16, 224²", photos, 224, 16, 100), ("p=4, 32²", small, 32, 4, 16)]:
        crops = [
            im[y : y + size, x : x + size]
            for im in images
            for y in range(0, im.shape[0] - size + 1, stride)
            for x in range(0, im.shape[1] - size + 1, stride)
        ]
        sets[name] = np.asarray(vit.patchify(jnp.asarray(np.stack(crops)), p))
    return sets


def run_photos() -> dict:
    import jax
    import jax.numpy as jnp

    from skipless_jax import token_graying as tg

    fns = {name: jax.jit(fn) for name, fn in tg.TOKEN_GRAYING.items()}
    results = {}
    for set_name, x in photo_sets().items():
        lk = log_kappa(x)
        rows = []
        for eps in EPS_GRID:
            out = {name: np.asarray(fn(x, eps), np.float64) for name, fn in fns.items()}
            bf16 = {
                name: np.asarray(fn(x.astype(jnp.bfloat16), eps).astype(jnp.float32), np.float64)
                for name, fn in fns.items()
            }
            rows.append(
                dict(
                    eps=eps,
                    log_kappa_in=float(lk.mean()),
                    reduction_svd=float((lk - log_kappa(out["svd"])).mean()),
                    reduction_dct=float((lk - log_kappa(out["dct"])).mean()),
                    reduction_dct_min=float((lk - log_kappa(out["dct"])).min()),
                    reduction_dct_max=float((lk - log_kappa(out["dct"])).max()),
                    dist_dct_svd=float(rel(out["dct"], out["svd"]).mean()),
                    # How much of SVD-TG's change to X the DCT-TG change reproduces.
                    dist_dct_svd_over_change=float(
                        (
                            np.linalg.norm(out["dct"] - out["svd"], axis=(-2, -1))
                            / np.linalg.norm(out["svd"] - x, axis=(-2, -1))
                        ).mean()
                    ),
                    # Shape of the spectrum: mean over i of |log(σ_i/σ_1) of DCT-TG − that of SVD-TG|,
                    # and the scale: σ_1(DCT-TG)/σ_1(SVD-TG) (= σ_1(DCT-TG)/σ_1(X)).
                    spectrum_shape_dist=float(
                        np.abs(_log_normalized_sv(out["dct"]) - _log_normalized_sv(out["svd"])).mean()
                    ),
                    sigma_max_ratio=float((_sv(out["dct"])[:, 0] / _sv(out["svd"])[:, 0]).mean()),
                    change_svd=float(rel(out["svd"], x).mean()),
                    change_dct=float(rel(out["dct"], x).mean()),
                    fast_vs_svd_max=float(rel(out["svd_fast"], out["svd"]).max()),
                    bf16_input_rounding=float(rel(x.astype(jnp.bfloat16).astype(np.float32), x).mean()),
                    **{f"bf16_err_{n}": float(rel(bf16[n], out[n]).mean()) for n in fns},
                    **{f"bf16_err_{n}_max": float(rel(bf16[n], out[n]).max()) for n in fns},
                    **{
                        f"bf16_log_kappa_shift_{n}": float(np.abs(log_kappa(bf16[n]) - log_kappa(out[n])).mean())
                        for n in fns
                    },
                )
            )
        results[set_name] = dict(count=len(x), shape=list(x.shape[1:]), log_kappa=[float(v) for v in lk], rows=rows)
        # One spectrum for the figure: the median-κ crop.
        i = int(np.argsort(lk)[len(lk) // 2])
        results[set_name]["spectrum"] = {
            "input": np.linalg.svd(x[i].astype(np.float64), compute_uv=False).tolist(),
            **{
                f"{n} ε=0.6": np.linalg.svd(np.asarray(fns[n](x[i], 0.6), np.float64), compute_uv=False).tolist()
                for n in ("svd", "dct")
            },
        }
    return results


def photo_tables(results: dict) -> str:
    lines = []
    for set_name, res in results.items():
        lines += [
            (
                f"\n**{set_name}** patches ({res['count']} crops of {res['shape'][0]}×{res['shape'][1]}; "
                f"log κ(X) mean {np.mean(res['log_kappa']):.2f}, "
                f"range {min(res['log_kappa']):.2f}–{max(res['log_kappa']):.2f})\n"
            ),
            "| ε | log κ reduction, SVD-TG | log κ reduction, DCT-TG (min–max) | ‖DCT−SVD‖/‖SVD‖ | ‖DCT−SVD‖/‖SVD−X‖ "
            "| mean abs Δ log(σ_i/σ_1), DCT vs SVD | σ_1(DCT)/σ_1(X) | ‖SVD−X‖/‖X‖ | ‖DCT−X‖/‖X‖ | fast vs SVD (max) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in res["rows"]:
            lines.append(
                f"| {r['eps']} | {r['reduction_svd']:.3f} | {r['reduction_dct']:.3f} "
                f"({r['reduction_dct_min']:.3f}–{r['reduction_dct_max']:.3f}) | "
                f"{r['dist_dct_svd']:.4f} | {r['dist_dct_svd_over_change']:.2f} | {r['spectrum_shape_dist']:.3f} | "
                f"{r['sigma_max_ratio']:.2f} | {r['change_svd']:.4f} | {r['change_dct']:.4f} | "
                f"{r['fast_vs_svd_max']:.1e} |"
            )
    lines += [
        "\n**bf16 input, float32 compute, bf16 output** vs the float32 path "
        "(mean relative error; max in brackets; mean |Δ log κ| of the output)\n"
    ]
    lines += ["| patches | ε | bf16 rounding of X alone | SVD-TG | fast SVD-TG | DCT-TG |", "|---|---|---|---|---|---|"]
    for set_name, res in results.items():
        for r in res["rows"]:
            cells = [
                f"{r[f'bf16_err_{n}']:.2e} [{r[f'bf16_err_{n}_max']:.1e}]; Δlogκ {r[f'bf16_log_kappa_shift_{n}']:.3f}"
                for n in ("svd", "svd_fast", "dct")
            ]
            lines.append(f"| {set_name} | {r['eps']} | {r['bf16_input_rounding']:.2e} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def photo_figures(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (set_name, res) in zip(axes, results.items()):
        eps = [r["eps"] for r in res["rows"]]
        ax.plot(eps, [r["reduction_svd"] for r in res["rows"]], "o-", label="SVD-TG: (1−ε)·log κ")
        ax.errorbar(
            eps, [r["reduction_dct"] for r in res["rows"]],
            yerr=[
                [r["reduction_dct"] - r["reduction_dct_min"] for r in res["rows"]],
                [r["reduction_dct_max"] - r["reduction_dct"] for r in res["rows"]],
            ],
            fmt="s-", capsize=3, label="DCT-TG (min–max over crops)",
        )
        ax.set_xlabel("ε")
        ax.set_ylabel("log κ(X) − log κ(X̃)")
        ax.set_title(f"{set_name}: {res['count']} photo crops")
        ax.invert_xaxis()
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(FIGURES, "token_graying_kappa.png"), dpi=110)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (set_name, res) in zip(axes, results.items()):
        for label, s in res["spectrum"].items():
            ax.semilogy(np.asarray(s) / s[0], label=label)
        ax.set_xlabel("index i")
        ax.set_ylabel("σ_i / σ_max")
        ax.set_title(f"{set_name}: spectrum of the median-κ crop")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(FIGURES, "token_graying_spectrum.png"), dpi=110)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (set_name, res) in zip(axes, results.items()):
        eps = [r["eps"] for r in res["rows"]]
        ax.semilogy(eps, [r["bf16_input_rounding"] for r in res["rows"]], "k--", label="bf16 rounding of X alone")
        for n, marker in (("svd", "o"), ("svd_fast", "x"), ("dct", "s")):
            ax.semilogy(eps, [r[f"bf16_err_{n}"] for r in res["rows"]], marker + "-", label=n)
        ax.set_xlabel("ε")
        ax.set_ylabel("‖TG_bf16 − TG_f32‖ / ‖TG_f32‖")
        ax.set_title(f"{set_name}: bf16 in/out vs float32")
        ax.invert_xaxis()
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(FIGURES, "token_graying_bf16.png"), dpi=110)


def digit_runs(seeds: list[int]) -> dict[str, sweep.SweepRun]:
    """{result key: its sweep run}: configs/quickstart.py's named grid `tg_eps` for these seeds
    (the standard ViT these figures were made with; the quickstart's default is now skipless + SOAP)."""
    config = "configs/quickstart.py"  # relative to the checkout, where the sweep runs its runs
    module = sweep.load_config_module(os.path.join(ROOT, config))
    return {f"eps={eps}|seed={seed}":
            sweep.one_run(config, f"{STANDARD}," + ("tg=none" if eps == 1.0 else f"tg=svd,eps={eps}") + f",seed={seed}",
                          module)
            for eps in ABLATION_EPS for seed in seeds}


def run_digits(path: str, seeds: list[int], root: str, overrides: list[str] = (), workers: int = 1
               ) -> tuple[dict, int]:
    """The ε ablation on digits, trained with `python -m skipless_jax.sweep`'s runner into kept
    folders under `root` (resumable); `path` (JSON) written from the finished runs' final
    checkpoints. (results, the sweep's exit status)."""
    import jax
    import jax.numpy as jnp

    from skipless_jax import analyze, evaluate

    def record(workdir, metrics):
        config = evaluate.resolve_config(workdir, None)  # the config the run saved with its checkpoint
        model, shape = analyze.build(config)
        params, _, source = analyze.load_params(model, config, shape, workdir)  # the final checkpoint
        assert source == "checkpoint", source
        images = analyze.probe_images(config, 360)
        _, out = jax.jit(model.apply, static_argnames="train")({"params": params}, jnp.asarray(images), train=False)
        # X·W + b has rank ≤ d_in + 1 (5 here, of 16 tokens): κ over those singular values.
        rank = min(out["embedding"].shape[-2], out["patches"].shape[-1] + 1)
        return dict(
            eps=config.model.tg_eps if config.model.token_graying else 1.0, seed=config.seed,
            test_accuracy=metrics["test_accuracy"], test_loss=metrics["test_loss"],
            log_kappa_raw=float(log_kappa(_raw_patches(images, config)).mean()),
            log_kappa_in=float(log_kappa(out["patches"]).mean()),
            embedding_rank=rank,
            log_kappa_embedding=float(log_kappa(out["embedding"], rank).mean()),
        )

    runs = digit_runs(seeds)
    results, status = sweep.train_and_collect(runs, root, overrides, workers, record, path)
    return results, status


def _raw_patches(images: np.ndarray, config) -> np.ndarray:
    import jax.numpy as jnp

    from skipless_jax.models import vit

    return np.asarray(vit.patchify(jnp.asarray(images, jnp.float32), config.model.patch_size))


def digits_table(results: dict) -> str:
    lines = [
        "| ε | test accuracy (%) mean ± std (3 seeds) | per seed | log κ_in (after TG) | log κ of the embedding output "
        "| paper ViT-B top-1 | paper log κ_in |",
        "|---|---|---|---|---|---|---|",
    ]
    for eps in ABLATION_EPS:
        runs = [r for r in results.values() if r["eps"] == eps]
        if not runs:
            continue
        acc = 100 * np.array([r["test_accuracy"] for r in runs])
        label = "1 (no TG)" if eps == 1.0 else f"{eps}"
        lines.append(
            f"| {label} | {acc.mean():.1f} ± {acc.std():.1f} | {', '.join(f'{a:.1f}' for a in acc)} | "
            f"{np.mean([r['log_kappa_in'] for r in runs]):.2f} | "
            f"{np.mean([r['log_kappa_embedding'] for r in runs]):.2f} | "
            f"{PAPER_TOP1[eps]} | {PAPER_LOG_KAPPA_IN[eps]} |"
        )
    return "\n".join(lines)


def digits_figure(results: dict, path: str = os.path.join(FIGURES, "token_graying_digits.png")) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    eps = [e for e in ABLATION_EPS if any(r["eps"] == e for r in results.values())]
    acc = [[100 * r["test_accuracy"] for r in results.values() if r["eps"] == e] for e in eps]
    axes[0].errorbar(eps, [np.mean(a) for a in acc], yerr=[np.std(a) for a in acc], fmt="o-", capsize=3)
    axes[0].set_xlabel("ε")
    axes[0].set_ylabel("test accuracy (%)")
    axes[0].set_title("digits, SVD-TG ε ablation (3 seeds)")
    axes[0].invert_xaxis()
    for field, label in (("log_kappa_in", "log κ_in (after TG)"), ("log_kappa_embedding", "log κ(embedding output)")):
        means = [np.mean([r[field] for r in results.values() if r["eps"] == e]) for e in eps]
        axes[1].plot(eps, means, "o-", label=label)
    axes[1].plot(eps, [PAPER_LOG_KAPPA_IN[e] for e in eps], "k--", label="paper ViT-B log κ_in (ImageNet)")
    axes[1].set_xlabel("ε")
    axes[1].set_ylabel("mean log κ")
    axes[1].invert_xaxis()
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="all", choices=["photos", "digits", "all"])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--root", default=os.path.join(FIGURES, "token_graying_digits_runs"),
                        help="digits: the runs' folders (git-ignored under docs/figures/)")
    parser.add_argument("--out", default=os.path.join(FIGURES, "token_graying_digits"),
                        help="digits: <out>.json, <out>.png")
    parser.add_argument("--workers", type=int, default=1, help="digits: runs at a time")
    args, rest = parser.parse_known_args()
    overrides = sweep.overrides_of(parser, rest)
    os.makedirs(FIGURES, exist_ok=True)
    if args.part in ("photos", "all"):
        results = run_photos()
        with open(os.path.join(FIGURES, "token_graying_photos.json"), "w") as f:
            json.dump(results, f, indent=1)
        photo_figures(results)
        print(photo_tables(results))
    if args.part in ("digits", "all"):
        seeds = [int(s) for s in args.seeds.split(",")]
        results, status = run_digits(f"{args.out}.json", seeds, os.path.abspath(args.root), overrides, args.workers)
        digits_figure(results, f"{args.out}.png")
        print(digits_table(results))
        sys.exit(status)


if __name__ == "__main__":
    main()
