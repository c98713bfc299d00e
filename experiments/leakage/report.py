"""The leakage study's report: one line per attack result, the run's summary, and the
"What leaked" section of ``summary.md`` and ``run.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from server.results import RunFolder, read_run_info


def headline(line: dict[str, Any]) -> str:
    if "skipped" in line:
        return f"skipped ({line['skipped']})"
    a = line["attack"]
    if a in ("invert", "dlg"):
        extra = f", SSIM {line['ssim']:.3f}" if "ssim" in line else ""
        base = f" (random images: {line['psnr-random']:.1f} dB)" if "psnr-random" in line else ""
        return (f"PSNR {line['psnr']:.2f} dB{extra}{base}, label accuracy "
                f"{line['label-accuracy']:.2f} ({line['labels']} labels), {line['seconds']:.0f} s")
    if a == "labels":
        return f"label accuracy {line['label-accuracy']:.2f} ({line['method']})"
    if a == "mia":
        lo, hi = line["auc-ci95"]
        tpr = line["tpr-at-1%fpr"]
        return (f"AUC {line['auc']:.3f} (95% CI {lo:.2f}-{hi:.2f}, {line['members']} members), "
                + ("TPR at 1% FPR not measurable (under 100 non-members)" if tpr is None
                   else f"TPR {tpr:.3f} at 1% FPR") + f" ({line['attack-used']})")
    claimed = line.get("epsilon-claimed")
    return (f"epsilon >= {line['epsilon-lower-bound']:.3f} at {line['confidence']:.0%} "
            f"({line['correct']}/{line['guesses']} guesses right); accountant: "
            + ("no DP" if claimed is None else f"{claimed:.3f}"))


def summarize(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Per attack, the mean over observations (the worst case for the audit)."""
    out: dict[str, Any] = {"observations": len({(x["round"], x["client"]) for x in lines})}
    for attack in dict.fromkeys(x["attack"] for x in lines):
        done = [x for x in lines if x["attack"] == attack and "skipped" not in x]
        if not done:
            continue
        keys = {"invert": ("psnr", "ssim", "psnr-random", "label-accuracy", "seconds"),
                "dlg": ("psnr", "ssim", "psnr-random", "label-accuracy", "seconds"),
                "labels": ("label-accuracy",), "mia": ("auc", "tpr-at-1%fpr", "tpr-at-0.1%fpr"),
                }.get(attack)
        if keys:
            out[attack] = {k: float(np.mean([x[k] for x in done if x.get(k) is not None]))
                           for k in keys if any(x.get(k) is not None for x in done)}
        else:  # the audit: the largest lower bound, next to what the accountant claims
            worst = max(done, key=lambda x: x["epsilon-lower-bound"])
            out[attack] = {k: worst[k] for k in ("epsilon-lower-bound", "epsilon-claimed",
                                                 "claimed-by", "confidence", "canaries",
                                                 "observations-audited", "audited", "round",
                                                 "client") if k in worst}
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
    if "invert" in summary:
        s = summary["invert"]
        lines.append(f"- reconstruction (Inverting Gradients): PSNR **{s['psnr']:.2f} dB**"
                     + (f", SSIM {s['ssim']:.3f}" if "ssim" in s else "")
                     + (f" (random images: {s['psnr-random']:.2f} dB)" if "psnr-random" in s
                        else "") + f", labels {s['label-accuracy']:.0%} right")
    if "dlg" in summary:
        lines.append(f"- reconstruction (DLG): PSNR {summary['dlg']['psnr']:.2f} dB")
    if "labels" in summary:
        lines.append(f"- labels read off the update: {summary['labels']['label-accuracy']:.0%}")
    if "mia" in summary:
        s = summary["mia"]
        low = [f"TPR {s[k]:.3f} at {rate} FPR" for k, rate in
               (("tpr-at-1%fpr", "1%"), ("tpr-at-0.1%fpr", "0.1%")) if k in s]
        lines.append(f"- membership inference (loss drop): AUC **{s['auc']:.3f}**"
                     + "".join(f", {t}" for t in low))
    if "audit" in summary:
        s = summary["audit"]
        claimed = s.get("epsilon-claimed")
        lines.append(f"- audit ({s['canaries']} canaries, {s['audited']}): epsilon >= "
                     f"**{s['epsilon-lower-bound']:.3f}** at {s['confidence']:.0%} confidence"
                     + (f" (jointly over {s['observations-audited']} observations, Bonferroni)"
                        if s.get("observations-audited", 1) > 1 else "")
                     + "; the accountant claims "
                     + ("nothing (no DP)" if claimed is None else f"{claimed:.3f}"))
    return "\n".join(lines) + "\n"

