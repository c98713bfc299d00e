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
        labels = (f", label accuracy {line['label-accuracy']:.2f} ({line['labels']} labels)"
                  if "label-accuracy" in line else "")
        share = (f", {line['recovered-above-30db']:.0%} of the records above 30 dB"
                 if "recovered-above-30db" in line else "")
        if line.get("label-accuracy-recovered") is not None and line["attack"] == "imprint":
            share += f" ({line['label-accuracy-recovered']:.0%} of them with the right label)"
        return (f"PSNR {line['psnr']:.2f} dB{extra}{base}{share}{labels}, "
                f"{line['seconds']:.0f} s")
    if kind == "labels":
        return f"label accuracy {line['label-accuracy']:.2f} ({line['method']})"
    if kind == "membership":
        lo, hi = line["auc-ci95"]
        tpr = line["tpr-at-1%fpr"]
        ci = line.get("tpr-at-1%fpr-ci95")
        return (f"AUC {line['auc']:.3f} (95% CI {lo:.2f}-{hi:.2f}, {line['members']} members, "
                f"{line.get('nonmembers', line['members'])} non-members), "
                + ("TPR at 1% FPR not measurable (under 100 non-members)" if tpr is None
                   else f"TPR {tpr:.3f} at 1% FPR"
                   + (f" (95% CI {ci[0]:.3f}-{ci[1]:.3f})" if ci else ""))
                + f" ({line['attack-used']})" + _claim_words(line))
    if kind == "audit":
        return _audit_headline(line)
    return "done"


def _claim_words(line: dict[str, Any]) -> str:
    """'; within the DP claim' or the violation, for a line checked against a claim."""
    if "claim-consistent" not in line:
        return ""
    eps = line["claim"]["epsilon"]
    if line["claim-consistent"]:
        return f"; within the DP claim (epsilon {eps:.3g})"
    return (f"; ABOVE THE DP CLAIM (epsilon {eps:.3g}): "
            + ", ".join(_violation_words(v) for v in violations([line])))


def violations(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every measured point above its run's DP claim, with the confidence it holds at."""
    out = []
    for x in lines:
        if x.get("claim-rejected-by") and x.get("claim-consistent") is False:  # an audit
            out.append({"round": x["round"], "client": x["client"], "attack": x["attack"],
                        "variant": ", ".join(x["claim-rejected-by"]),
                        "epsilon": x.get("epsilon-claimed"),
                        "confidence": x.get("confidence", 0.95), "audit": True})
        for variant, points in x.get("claim-checks", {}).items():
            out += [{"round": x["round"], "client": x["client"], "attack": x["attack"],
                     "variant": variant, "epsilon": x["claim"]["epsilon"],
                     "confidence": x["claim"]["confidence"], **p}
                    for p in points if p["violated"]]
    return out


def _violation_words(v: dict[str, Any]) -> str:
    if v.get("audit"):
        return (f"the audit's {v['variant']} bound rejects the claimed epsilon "
                f"{v['epsilon']:.3g} ({v['confidence']:.0%} confidence)")
    return (f"{v['variant']} at FPR <= {v['fpr-upper']:.3g}: TPR >= {v['tpr-lower']:.3f} "
            f"where the claim allows {v['bound']:.3f} ({v['confidence']:.0%} confidence)")


# Per kind of attack, the numbers the summary averages over observations.
MEANS = {"reconstruction": ("psnr", "ssim", "cosine", "psnr-random", "recovered-above-30db",
                            "label-accuracy", "label-accuracy-recovered", "seconds"),
         "labels": ("label-accuracy",),
         "membership": ("auc", "tpr-at-1%fpr", "tpr-at-0.1%fpr")}
AUDIT_KEYS = ("epsilon-lower-bound", "mu-lower-bound-fdp", "epsilon-lower-bound-fdp",
              "mu-lower-bound-gdp", "epsilon-estimate-gdp", "epsilon-claimed", "mu-claimed",
              "claimed-by", "claim-consistent", "claim-checked-by", "claim-rejected-by",
              "confidence", "canaries", "guesses", "correct", "observations-audited",
              "audited", "round", "rounds", "client", "scope")


def _audit_headline(line: dict[str, Any]) -> str:
    """The three bounds and the claim check of one audit line."""
    claimed = line.get("epsilon-claimed")
    verdict = {None: "", True: ", consistent", False: ", REJECTED by "
               + ", ".join(line.get("claim-rejected-by", []))}[line.get("claim-consistent")]
    return (f"epsilon >= {line['epsilon-lower-bound']:.3f} (Steinke), >= "
            f"{line.get('epsilon-lower-bound-fdp', 0.0):.3f} (f-DP, mu >= "
            f"{line.get('mu-lower-bound-fdp', 0.0):.3f}), about "
            f"{line.get('epsilon-estimate-gdp', 0.0):.3f} (GDP, mu >= "
            f"{line.get('mu-lower-bound-gdp', 0.0):.3f}) at {line['confidence']:.0%} jointly "
            f"({line['correct']}/{line['guesses']} guesses right); accountant: "
            + ("no DP (no claim)" if claimed is None else f"{claimed:.3f}{verdict}"))


def summarize(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Per attack, the mean over observations (the worst case for the audit); for
    reconstructions also n, the 95% interval and the per-update spread (:mod:`.spread`)."""
    out: dict[str, Any] = {"observations": len({(x["round"], x["client"]) for x in lines})}
    for attack in dict.fromkeys(x["attack"] for x in lines):
        done = [x for x in lines if x["attack"] == attack and "skipped" not in x]
        kind = _kind(attack)
        if not done or kind is None:
            continue
        if kind == "audit":  # the whole run's audit when there is one, else the largest
            runs = [x for x in done if x.get("scope") == "run"] or done
            worst = max(runs, key=lambda x: (x.get("epsilon-estimate-gdp", 0.0),
                                             x["epsilon-lower-bound"]))
            out[attack] = {k: worst[k] for k in AUDIT_KEYS if k in worst}
            verdicts = [x["claim-consistent"] for x in done
                        if x.get("claim-consistent") is not None]
            out[attack]["claim-consistent"] = all(verdicts) if verdicts else None
            continue
        out[attack] = {k: float(np.mean([x[k] for x in done if x.get(k) is not None]))
                       for k in MEANS[kind] if any(x.get(k) is not None for x in done)}
        if kind == "reconstruction":
            out[attack].update(reconstruction_spread(done))
        checked = [x for x in done if "claim-consistent" in x]
        if checked:
            out[attack]["claim-consistent"] = all(x["claim-consistent"] for x in checked)
    if any(x.get("claim-consistent") is not None for x in lines):  # a DP run, checked
        out["claim-violations"] = violations(lines)
    return out


def record(run_dir: Path, summary: dict[str, Any]) -> None:
    """run.json's "leakage" and summary.md's "What leaked" section."""
    run = RunFolder(run_dir)
    info = read_run_info(run_dir)
    info["leakage"] = summary
    if "claim-violations" in summary:
        info["claim-consistent"] = not summary["claim-violations"]
    run.write_json("run.json", info)
    text = (run_dir / "summary.md").read_text() if (run_dir / "summary.md").exists() else ""
    text = text.split("\n## What leaked\n")[0].rstrip() + "\n\n" + leakage_section(summary)
    run.write_text("summary.md", text)


def leakage_section(summary: dict[str, Any]) -> str:
    lines = ["## What leaked", "",
             f"Attacks on {summary['observations']} observation(s) of what the server saw "
             "(`leakage.jsonl`, `plots/leakage/`):", ""]
    for attack, s in summary.items():
        kind = _kind(attack) if attack not in ("observations", "claim-violations") else None
        if kind is not None:
            lines.append(f"- {_title(attack)}: {SECTION[kind](s)}")
    found = summary.get("claim-violations")
    if found is not None:
        lines += ["", claim_verdict(found)]
    return "\n".join(lines) + "\n"


def claim_verdict(found: list[dict[str, Any]]) -> str:
    """One paragraph: every attack within the run's DP claim, or where it is not."""
    if not found:
        return ("Every attack is consistent with the run's DP claim: the membership "
                "attacks' operating points lie within the curve it allows (checked at 0.1%, "
                "1% and 10% FPR where the non-members suffice, at 95% confidence) and no "
                "audit bound rejects it.")
    return ("**The DP claim is contradicted by a measurement**: "
            + "; ".join(f"round {v['round']} client {v['client']}: {_violation_words(v)}"
                        for v in found)
            + ". Either the accounting is wrong or the mechanism run is not the one "
              "accounted (e.g. less noise than claimed).")


def _reconstruction(s: dict[str, Any]) -> str:
    return (describe(s)
            + (f" (random images: {s['psnr-random']:.2f} dB)" if "psnr-random" in s else "")
            + (f", labels {s['label-accuracy']:.0%} right" if "label-accuracy" in s else ""))


def _membership(s: dict[str, Any]) -> str:
    low = [f"TPR {s[k]:.3f} at {rate} FPR" for k, rate in
           (("tpr-at-1%fpr", "1%"), ("tpr-at-0.1%fpr", "0.1%")) if k in s]
    claim = ({True: "; within the DP claim", False: "; **above the DP claim**"}
             [s["claim-consistent"]] if "claim-consistent" in s else "")
    return f"AUC **{s['auc']:.3f}**" + "".join(f", {t}" for t in low) + claim


def _audit(s: dict[str, Any]) -> str:
    rounds = s.get("rounds")
    scope = f"rounds {', '.join(map(str, rounds))} together" if rounds else \
        f"round {s.get('round')}"
    return (f"{s['canaries']} canaries, {s['audited']}, {scope}: "
            + _audit_headline(s).replace("epsilon >= ", "epsilon >= **", 1)
            .replace(" (Steinke)", "** (Steinke)", 1)
            + (f" (Bonferroni over {s['observations-audited']} audits)"
               if s.get("observations-audited", 1) > 1 else "")
            + ("" if s.get("claim-consistent") is None else
               f"; claim consistent with every audit: {s['claim-consistent']}"))


# summary.md's line for each kind of attack (AttackInfo.scored_as)
SECTION = {"reconstruction": _reconstruction,
           "labels": lambda s: f"{s['label-accuracy']:.0%} right",
           "membership": _membership,
           "audit": _audit}
