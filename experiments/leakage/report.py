"""The leakage study's report: one line per attack result, the run's summary, and the
"What leaked" section of ``summary.md`` and ``run.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from privacy.attacks.registry import ATTACKS
from tasks.results.folder import RunFolder, read_run_info

from .spread import describe, reconstruction_spread


def _kind(attack: str) -> str | None:
    """How the attack is scored (None: not registered in this process)."""
    return ATTACKS.info(attack).scored_as if attack in ATTACKS else None


def _title(attack: str) -> str:
    return (ATTACKS.info(attack).title if attack in ATTACKS else "") or attack


def headline(line: dict[str, Any]) -> str:
    if "skipped" in line:
        return f"skipped ({line['skipped']})"
    kind = _kind(line["attack"])
    if kind == "reconstruction":
        extra = f", SSIM {line['ssim']:.3f}" if "ssim" in line else ""
        base = f" (random images: {line['psnr-random']:.1f} dB)" if "psnr-random" in line else ""
        return (f"PSNR {line['psnr']:.2f} dB{extra}{base}, label accuracy "
                f"{line['label-accuracy']:.2f} ({line['labels']} labels), {line['seconds']:.0f} s")
    if kind == "labels":
        return f"label accuracy {line['label-accuracy']:.2f} ({line['method']})"
    if kind == "membership":
        lo, hi = line["auc-ci95"]
        tpr = line["tpr-at-1%fpr"]
        return (f"AUC {line['auc']:.3f} (95% CI {lo:.2f}-{hi:.2f}, {line['members']} members), "
                + ("TPR at 1% FPR not measurable (under 100 non-members)" if tpr is None
                   else f"TPR {tpr:.3f} at 1% FPR") + f" ({line['attack-used']})")
    if kind == "audit":
        claimed = line.get("epsilon-claimed")
        return (f"epsilon >= {line['epsilon-lower-bound']:.3f} at {line['confidence']:.0%} "
                f"({line['correct']}/{line['guesses']} guesses right); accountant: "
                + ("no DP" if claimed is None else f"{claimed:.3f}"))
    return "done"


# Per kind of attack, the numbers the summary averages over observations.
MEANS = {"reconstruction": ("psnr", "ssim", "cosine", "psnr-random", "label-accuracy",
                            "seconds"),
         "labels": ("label-accuracy",),
         "membership": ("auc", "tpr-at-1%fpr", "tpr-at-0.1%fpr")}
AUDIT_KEYS = ("epsilon-lower-bound", "epsilon-claimed", "claimed-by", "confidence", "canaries",
              "observations-audited", "audited", "round", "client")


def summarize(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Per attack, the mean over observations (the worst case for the audit); for
    reconstructions also n, the 95% interval and the per-update spread (:mod:`.spread`)."""
    out: dict[str, Any] = {"observations": len({(x["round"], x["client"]) for x in lines})}
    for attack in dict.fromkeys(x["attack"] for x in lines):
        done = [x for x in lines if x["attack"] == attack and "skipped" not in x]
        kind = _kind(attack)
        if not done or kind is None:
            continue
        if kind == "audit":  # the largest lower bound, next to what the accountant claims
            worst = max(done, key=lambda x: x["epsilon-lower-bound"])
            out[attack] = {k: worst[k] for k in AUDIT_KEYS if k in worst}
            continue
        out[attack] = {k: float(np.mean([x[k] for x in done if x.get(k) is not None]))
                       for k in MEANS[kind] if any(x.get(k) is not None for x in done)}
        if kind == "reconstruction":
            out[attack].update(reconstruction_spread(done))
    return out


def record(run_dir: Path, summary: dict[str, Any]) -> None:
    """run.json's "leakage" and summary.md's "What leaked" section."""
    run = RunFolder(run_dir)
    info = read_run_info(run_dir)
    info["leakage"] = summary
    run.write_json("run.json", info)
    text = (run_dir / "summary.md").read_text() if (run_dir / "summary.md").exists() else ""
    text = text.split("\n## What leaked\n")[0].rstrip() + "\n\n" + leakage_section(summary)
    run.write_text("summary.md", text)


def leakage_section(summary: dict[str, Any]) -> str:
    lines = ["## What leaked", "",
             f"Attacks on {summary['observations']} observation(s) of what the server saw "
             "(`leakage.jsonl`, `plots/leakage/`):", ""]
    for attack, s in summary.items():
        kind = _kind(attack) if attack != "observations" else None
        if kind is not None:
            lines.append(f"- {_title(attack)}: {SECTION[kind](s)}")
    return "\n".join(lines) + "\n"


def _reconstruction(s: dict[str, Any]) -> str:
    return (describe(s)
            + (f" (random images: {s['psnr-random']:.2f} dB)" if "psnr-random" in s else "")
            + (f", labels {s['label-accuracy']:.0%} right" if "label-accuracy" in s else ""))


def _membership(s: dict[str, Any]) -> str:
    low = [f"TPR {s[k]:.3f} at {rate} FPR" for k, rate in
           (("tpr-at-1%fpr", "1%"), ("tpr-at-0.1%fpr", "0.1%")) if k in s]
    return f"AUC **{s['auc']:.3f}**" + "".join(f", {t}" for t in low)


def _audit(s: dict[str, Any]) -> str:
    claimed = s.get("epsilon-claimed")
    return (f"{s['canaries']} canaries, {s['audited']}: epsilon >= "
            f"**{s['epsilon-lower-bound']:.3f}** at {s['confidence']:.0%} confidence"
            + (f" (jointly over {s['observations-audited']} observations, Bonferroni)"
               if s.get("observations-audited", 1) > 1 else "")
            + "; the accountant claims "
            + ("nothing (no DP)" if claimed is None else f"{claimed:.3f}"))


# summary.md's line for each kind of attack (AttackInfo.scored_as)
SECTION = {"reconstruction": _reconstruction,
           "labels": lambda s: f"{s['label-accuracy']:.0%} right",
           "membership": _membership,
           "audit": _audit}
