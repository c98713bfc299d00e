"""summary.md: the one page a person reads after a run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .results import RunFolder


def outcome(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Final and best test accuracy of a ledger, plus steady-state round time."""
    if not records:
        return {}
    best = max(records, key=lambda r: r["test"]["accuracy"])
    times = [r["time"]["round-s"] for r in records]
    steady = times[1:] if len(times) > 1 else times
    return {
        "final": {"round": records[-1]["round"], **records[-1]["test"]},
        "best": {"round": best["round"], **best["test"]},
        "mean-round-s": sum(times) / len(times),
        "steady-round-s": sum(steady) / len(steady),
    }


def write_summary(run: RunFolder, cfg: Mapping[str, Any], info: Mapping[str, Any],
                  records: Sequence[Mapping[str, Any]]) -> None:
    res = outcome(records)
    lines = [
        f"# fedpriv run — {cfg['dataset']} · {info.get('model')} · {cfg['strategy']}",
        "",
        f"- status: **{info.get('status')}**, {info.get('rounds-completed', 0)} of "
        f"{cfg['num-server-rounds']} rounds; started {info.get('started')}",
        f"- data: {info.get('dataset')}",
        f"- federation: {info.get('num-clients')} clients, partitioner `{cfg['partitioner']}`, "
        f"fraction-train {cfg['fraction-train']}, {cfg['local-epochs']} local epoch(s), "
        f"batch {cfg['batch-size']}, lr {cfg['lr']}, seed {cfg['seed']}",
        f"- model: `{info.get('model')}` ({info.get('parameters', 0):,} parameters)",
    ]
    privacy = info.get("privacy", {})
    if privacy.get("mode") == "local":
        lines.append(
            f"- privacy: local DP-SGD (record-level, per client): epsilon max "
            f"**{privacy['epsilon-max']:.3f}**, mean {privacy['epsilon-mean']:.3f} over all "
            f"clients at delta <= {privacy['delta-max']:.2g}; target-epsilon "
            f"{privacy['target-epsilon'] or 'none'}; {privacy['clients-out-of-budget']} "
            "client(s) ran out of budget"
            + (f" (first in round {privacy['first-out-of-budget-round']})"
               if privacy.get("first-out-of-budget-round") else ""))
    elif privacy.get("mode") == "central":
        lines.append(
            f"- privacy: central DP-FedAvg (client-level): epsilon **{privacy['epsilon']:.3f}** "
            f"at delta {privacy['delta']:.2g} after {privacy['releases']} releases; noise "
            f"multiplier {privacy['noise-multiplier']}, {privacy['clipping']} clipping "
            f"(norm {privacy['clipping-norm']:.3g}), {privacy['sampled']} of "
            f"{privacy['population']} clients per round; {privacy['accounting']}. The server "
            "still sees raw updates.")
    anon = info.get("anonymization")
    if anon:
        m = anon["mean"]

        def f(key: str) -> str:
            v = m.get(key)
            return "n/a" if v is None else f"{v:.3f}"

        lines.append(
            f"- anonymization: `{anon['anonymizer']}`; mean over clients: re-identification "
            f"top-1 **{f('reid-top1')}** (chance {f('reid-chance')}), top-5 {f('reid-top5')}; "
            f"membership-inference AUC **{f('mia-auc')}** (TPR at 1% FPR "
            f"{f('mia-tpr-at-1%fpr')}); DCR share {f('dcr-share')} (baseline "
            f"{f('dcr-baseline')}); k-level {f('k-level')}; overlap {f('overlap')}")
    if info.get("backbone"):
        b = info["backbone"]
        lines.append(f"- features: {b.get('embedding-dim')}-d embeddings of a frozen "
                     f"{b.get('backbone')} trained on {b.get('trained-on')}")
    if info.get("stopped-early"):
        lines.append(f"- stopped early: {info['stopped-early']}")
    if res:
        initial = info.get("initial", {})
        lines += [
            f"- test accuracy: initial {initial.get('accuracy', float('nan')):.4f} → final "
            f"**{res['final']['accuracy']:.4f}** (best {res['best']['accuracy']:.4f} at round "
            f"{res['best']['round']})",
            f"- time: {info.get('setup-s', 0):.1f} s server setup, {res['mean-round-s']:.2f} s a "
            f"round on average ({res['steady-round-s']:.2f} s after round 1)",
            "",
            "| round | test acc | test loss | train loss | clients | round s |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in records:
            train_loss = r["train"].get("loss")
            lines.append(
                f"| {r['round']} | {r['test']['accuracy']:.4f} | {r['test']['loss']:.4f} | "
                f"{'-' if train_loss is None else f'{train_loss:.4f}'} | "
                f"{len(r['clients'])}/{len(r['sampled'])} | {r['time']['round-s']:.2f} |")
    lines += ["", "![accuracy](plots/accuracy.png)", "", "![loss](plots/loss.png)", ""]
    if privacy.get("mode") in ("local", "central"):
        lines += ["![epsilon](plots/epsilon.png)", ""]
    lines += [
              "![label distribution](plots/label_distribution.png)", "",
              "Files: `config.toml` (resolved config), `metrics.jsonl` (one record per round), "
              "`partitions.json` (client sizes and label counts), `run.json` (status, timings, "
              "versions), `model.pt` (final global model).", ""]
    run.write_text("summary.md", "\n".join(lines))
