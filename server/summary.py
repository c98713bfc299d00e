"""summary.md: the one page a person reads after a run."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from privacy.dp.disclosure import declined
from strategies.rounds import short_reason
from tasks.config import RunConfig
from tasks.markdown import markdown_table
from tasks.results.exposure import headline, read_exposure
from tasks.results.folder import RunFolder
from tasks.results.info import RunInfo
from tasks.results.ledger import RoundRecord, headline_epsilon, outcome

from .console import number

RELEASE_SCATTER = "release_scatter.png"  # experiments/leakage/release_plot.py draws it
SCATTER_LINE = f"![original vs released embeddings](plots/{RELEASE_SCATTER})"
LOSS_LINE = "![loss](plots/loss.png)"
CANARY_AUDIT = "audit-canary-clients.json"  # canary-clients: server.federation writes it


def canary_audit_text(audit: Mapping[str, Any]) -> str:
    """The canary-client audit's verdict in one sentence (without the list marker)."""
    claim = audit.get("epsilon-claimed")
    verdict = ("no claim to check" if audit.get("claim-consistent") is None else
               "consistent with the claim" if audit["claim-consistent"] else
               f"**the claim is rejected** (by {', '.join(audit['claim-rejected-by'])})")
    return (f"canary-client audit (Andrew et al. 2024; {audit['canary-clients']} canary "
            f"clients, {audit['held-out']} held out, {audit['rounds']} rounds): epsilon "
            f"lower bound **{audit['epsilon-lower-bound-oneshot']:.3f}** (one-shot, "
            f"{audit['confidence']:.0%} confidence), estimate "
            f"{audit['epsilon-estimate-oneshot']:.3f}, GDP bound "
            f"{audit['epsilon-estimate-gdp']:.3f}; claimed "
            + ("none" if claim is None else f"{claim:.3f}") + f": {verdict}")


def canary_audit_lines(run_dir: Path) -> list[str]:
    """summary.md's line for audit-canary-clients.json, when the run wrote one."""
    path = run_dir / CANARY_AUDIT
    if not path.is_file():
        return []
    return [f"- {canary_audit_text(json.loads(path.read_text()))} (`{CANARY_AUDIT}`)"]


def exposure_lines(run_dir: Path) -> list[str]:
    """summary.md's line for the canaries' exposure (exposure.jsonl), when the run planted
    canaries."""
    rows = read_exposure(run_dir)
    if not rows:
        return []
    last = max(r["round"] for r in rows)
    space = rows[0]["space"]
    means = ", ".join(f"{reps}x: {value:.2f} bits" for reps, value in headline(rows).items())
    return [f"- memorization (Secret Sharer, Carlini et al. 2019): mean exposure of the "
            f"canaries by repetitions, round {last}: {means} (at most log2 |R| = "
            f"{math.log2(space):.1f}; about 1 at chance; `exposure.jsonl`, "
            "`plots/exposure.png`)"]


def privacy_lines(privacy: Mapping[str, Any], aggregation: Mapping[str, Any],
                  cfg: RunConfig) -> list[str]:
    """What the run's epsilon covers, under which neighbouring relation, and what the
    server could read in the clear."""
    lines = []
    if privacy.get("mode") == "local":
        unit = privacy.get("unit", "record")
        lines.append(
            f"- privacy: local DP-SGD ({unit}-level, per client; neighbours: "
            f"{privacy.get('neighbours', 'add or remove one record')}): epsilon max "
            f"**{privacy['epsilon-max']:.3f}**, mean {privacy['epsilon-mean']:.3f} over all "
            f"clients at delta <= {privacy['delta-max']:.2g}; target-epsilon "
            f"{privacy['target-epsilon'] or 'none'}; {privacy['clients-out-of-budget']} "
            "client(s) ran out of budget"
            + (f" (first in round {privacy['first-out-of-budget-round']})"
               if privacy.get("first-out-of-budget-round") else "")
            + (f"; accountant {privacy['accountant']}; public: {privacy['public']}"
               if "accountant" in privacy else ""))
        if unit != "record":
            lines.append(
                f"- **the epsilon is per released row, not per person**: DP-SGD trained on "
                f"what `{cfg.anonymization.anonymizer}` released, and one original record can "
                "change every released row of it (data-dependent groups or fit), so no per-record "
                "guarantee follows. Set dp-train-data = 'original' for a per-record epsilon.")
    elif privacy.get("mode") == "central":
        lines.append(
            f"- privacy: central DP-FedAvg (client-level; neighbours: "
            f"{privacy.get('neighbours')}): epsilon **{privacy['epsilon']:.3f}** at delta "
            f"{privacy['delta']:.2g} after {privacy['releases']} releases; noise multiplier "
            f"{privacy['noise-multiplier']}, {privacy['clipping']} clipping (norm "
            f"{privacy['clipping-norm']:.3g}), {privacy['sampling']} client sampling, sum "
            f"divided by {privacy['denominator']:g} of {privacy['population']} clients; "
            f"{privacy['accounting']}. It protects the released model from its users: the "
            "server still sees raw updates"
            + (f" ({aggregation.get('protocol')} hides them)"
               if aggregation.get("individual-updates-visible") is False else "") + ".")
    elif privacy.get("mode") == "distributed":
        lines.append(
            f"- privacy: distributed DP (client-level, against the server too; neighbours: "
            f"{privacy.get('neighbours')}): epsilon max **{privacy['epsilon-max']:.3f}**, mean "
            f"{privacy['epsilon-mean']:.3f} over all clients at delta {privacy['delta']:.2g}; "
            f"{privacy['mechanism']}, noise multiplier {privacy['noise-multiplier']} on the "
            f"sum of updates clipped to {privacy['clipping-norm']:.3g}, {privacy['bits']}-bit "
            f"modular sum, {privacy['colluding']} colluding client(s) assumed; amplification "
            f"{privacy['amplification']}; {privacy['accountant']}.")
    seen = aggregation.get("client-values-in-clear")
    if seen is not None:
        what = ("every metric a client computes" if seen == "all"
                else ", ".join(f"`{k}`" for k in seen))
        hidden = aggregation.get("individual-updates-visible") is False
        lines.append(f"- what the server could read of each client besides the "
                     f"{'secure sum' if hidden else 'update'}"
                     f": {what} — {aggregation.get('why')}.")
        if cfg.privacy.report_client_metrics and (cfg.privacy.dp == "local"
                                                  or cfg.secagg.enabled):
            lines.append("- **report-client-metrics = true**: the clients' training and "
                         "evaluation metrics, label histograms and release scores in this "
                         "run were sent in the clear and are covered by no epsilon.")
    return lines


def failure_lines(records: Sequence[RoundRecord], info: RunInfo,
                  most: int = 10) -> list[str]:
    """Which clients failed, when and why; and each time the run was resumed."""
    failures = [(r.round, f) for r in records for f in r.failures]
    lines = []
    if failures:
        lines.append(f"- client failures: {len(failures)} in "
                     f"{len({rnd for rnd, _ in failures})} round(s) (refused or lost replies; "
                     "each round aggregated the others):")
        lines += [f"  - round {rnd}, client {f.get('partition-id')}"
                  f"{' (' + f['phase'] + ')' if f.get('phase') else ''}: "
                  f"{short_reason(str(f.get('error', '')))[:300]}"
                  for rnd, f in failures[:most]]
        if len(failures) > most:
            lines.append(f"  - ... {len(failures) - most} more in metrics.jsonl")
    tampered = [r for r in records if r.tampered]
    if tampered:
        rounds = ", ".join(str(r.round) for r in tampered)
        lines.append(f"- **malicious server**: in round(s) {rounds} the server sent trap "
                     f"weights ({tampered[0].tampered}) instead of the "
                     "global model, kept what came back, and threw the round's result away: "
                     "the accuracy shown for those rounds is the honest model's of the round "
                     "before (see What leaked).")
    silent = [(r.round, c) for r in records for c in r.skipped]
    if silent:
        rnd, client = silent[0]
        lines.append(f"- clients that sent no update: {len(silent)}, e.g. round {rnd}, "
                     f"client {client.get('partition-id')}: {declined(client)}")
    refused = [r for r in records if r.refused]
    if refused:
        lines.append(f"- rounds refused (no aggregate, the model unchanged): "
                     f"{len(refused)}, e.g. round {refused[0].round}: {refused[0].refused}")
    for r in info.resumed:
        how = "restarted automatically" if r.get("automatic") else "resumed"
        lines.append(f"- {how} after round {r.get('from-round')} ({r.get('at')}); it had "
                     f"{r.get('status')}: {r.get('error')}")
    return lines


def reported_lines(info: RunInfo) -> list[str]:
    """The reported model (selected on validation) and its robustness to test noise."""
    out = []
    selection = info.model_selection
    if selection:
        test = selection["test"]
        auroc = test.get("auroc")
        out.append(f"- reported model: round {selection['round']} ({selection['rule']}, on "
                   f"{selection['validation-fraction']:.0%} of the held-out set): test "
                   f"accuracy **{test['accuracy']:.4f}**"
                   + (f", AUROC **{auroc:.4f}**" if auroc is not None else ""))
    noise = info.robustness
    if noise:
        out.append("- robustness (Gaussian noise on the test inputs): " + "; ".join(
            f"sigma {r['sigma']:g}: accuracy {r['accuracy']:.4f}"
            + (f", AUROC {r['auroc']:.4f}" if r.get("auroc") is not None else "")
            for r in noise))
    return out


def anonymization_line(anon: Mapping[str, Any]) -> str:
    """The release's scores, averaged over the clients, as one line."""
    m = anon["mean"]

    def f(key: str) -> str:
        v = m.get(key)
        return "n/a" if v is None else f"{v:.3f}"

    return (f"- anonymization: `{anon['anonymizer']}`; mean over clients: re-identification "
            f"top-1 **{f('reid-top1')}** (chance {f('reid-chance')}), top-5 {f('reid-top5')}; "
            f"membership-inference AUC **{f('mia-auc')}** (TPR at 1% FPR "
            f"{f('mia-tpr-at-1%fpr')}); DCR share {f('dcr-share')} (baseline "
            f"{f('dcr-baseline')}); k-level {f('k-level')}; overlap {f('overlap')}")


def outcome_lines(info: RunInfo, res: Mapping[str, Any],
                  records: Sequence[RoundRecord]) -> list[str]:
    """Accuracy from start to end, time, the reported model, and the table of rounds."""
    initial = info.initial or {}
    lines = [
        f"- test accuracy: initial {initial.get('accuracy', float('nan')):.4f} → final "
        f"**{res['final']['accuracy']:.4f}** (best {res['best']['accuracy']:.4f} at round "
        f"{res['best']['round']})",
        f"- time: {info.setup_s or 0:.1f} s server setup, {res['mean-round-s']:.2f} s a "
        f"round on average ({res['steady-round-s']:.2f} s after round 1)",
        *reported_lines(info),
        "",
    ]
    private = any(headline_epsilon(r.privacy) is not None for r in records)
    rows = []
    if initial:  # round 0: the model the run started from
        rows.append(["0", f"{initial.get('accuracy', float('nan')):.4f}",
                     number(initial.get("loss", float("nan"))), "-", "-", "-",
                     *(["0"] if private else [])])
    for r in records:
        train_loss = r.train.get("loss")
        eps = headline_epsilon(r.privacy)
        rows.append([f"{r.round}{' (tampered)' if r.tampered else ''}",
                     f"{r.test['accuracy']:.4f}", number(r.test["loss"]),
                     "-" if train_loss is None else number(train_loss),
                     f"{len(r.clients)}/{len(r.sampled)}", f"{r.time['round-s']:.2f}",
                     *([("-" if eps is None else f"{eps:.3g}")] if private else [])])
    head = ["round", "test acc", "test loss", "train loss", "clients", "round s"]
    if private:  # local: the largest over clients; central: client-level
        head.append("epsilon")
    return lines + markdown_table(head, rows, ["right"] * len(head))


def spent_so_far(records: Sequence[RoundRecord]) -> list[str]:
    """For a run that stopped before its privacy report: the epsilon its ledger holds for
    the last round it finished (local: the largest over clients; central: client-level)."""
    last = next((r for r in reversed(records) if headline_epsilon(r.privacy) is not None),
                None)
    if last is None:
        return []
    p = last.privacy
    delta = p.get("delta-max", p.get("delta"))
    return [f"- privacy: {p.get('mode')} DP, epsilon **{headline_epsilon(p):.3f}**"
            + (f" at delta {delta:.2g}" if isinstance(delta, (int, float)) else "")
            + f" spent by round {last.round}, the last it finished (the run stopped before "
            "its full privacy report)"]


def resume_hint(run_dir: Path) -> str:
    """How an unfinished run goes on: from its last checkpointed round, or from the start
    when it kept no checkpoint or can never be resumed (:func:`cannot_resume`)."""
    if not (run_dir / "checkpoint" / "server.npz").is_file():
        return "it kept no checkpoint to resume from; run it again"
    from server.checkpoint import cannot_resume  # Flower: only when a run stopped
    from tasks.config import validate
    from tasks.results.folder import read_run_info, read_saved_config

    try:
        why = cannot_resume(validate(read_saved_config(run_dir, "")), read_run_info(run_dir))
    except Exception:  # an unreadable file: --resume itself says what is wrong
        why = None
    if why is not None:
        return f"it cannot be resumed: {why}; run it again"
    return (f"continue it from its last finished round with `fedpriv run --resume "
            f"{run_dir}` (Python: `fedpriv.resume({str(run_dir)!r})`)")


def write_unfinished_summary(run_dir: Path, cfg: RunConfig) -> bool:
    """summary.md for a run that stopped before its end (Ctrl-C, a crash, a failure): the
    rounds it finished, why it stopped and how to go on. False when it finished no round
    (nothing to sum up) or is not unfinished."""
    from tasks.results.folder import read_run_info
    from tasks.results.ledger import read_ledger

    info = RunInfo.from_json(read_run_info(run_dir))
    records = read_ledger(run_dir)
    if not records or info.status not in ("interrupted", "crashed", "failed"):
        return False
    info.rounds_completed = info.rounds_completed or len(records)
    if not (run_dir / "plots" / "accuracy.png").is_file():  # its process was stopped first
        from tasks.results.folder import settings_title
        from tasks.results.plots import budget, plot_run

        title = (f"{cfg.data.dataset} · {info.model or cfg.training.model} · "
                 f"{cfg.federation.strategy} · {cfg.federation.num_clients} clients · "
                 f"{settings_title(cfg)}")
        plot_run(run_dir / "plots", records, info.initial, title, budget(run_dir))
    write_summary(RunFolder(run_dir), cfg, info, records)
    return True


def write_summary(run: RunFolder, cfg: RunConfig, info: RunInfo,
                  records: Sequence[RoundRecord]) -> None:
    res = outcome(records)
    fed, t = cfg.federation, cfg.training
    lines = [
        f"# fedpriv run — {cfg.data.dataset} · {info.model} · {fed.strategy}",
        "",
        f"- status: **{info.status}**, {info.rounds_completed or 0} of "
        f"{fed.num_server_rounds} rounds; started {info.started}",
        f"- data: {info.dataset}",
        f"- federation: {info.num_clients} clients, partitioner "
        f"`{cfg.data.partitioner}`, fraction-train {fed.fraction_train}, {t.local_epochs} local "
        f"epoch(s)" + (f" of at most {t.local_steps} steps" if t.local_steps else "")
        + f", batch {t.batch_size}, lr {t.lr}, seed {t.seed}",
        f"- model: `{info.model}` ({info.parameters or 0:,} parameters)",
    ]
    lines += (privacy_lines(info.privacy, info.aggregation or {}, cfg) if info.privacy
              else spent_so_far(records))
    lines += canary_audit_lines(run.path)
    lines += exposure_lines(run.path)
    if info.anonymization:
        lines.append(anonymization_line(info.anonymization))
    if info.backbone:
        b = info.backbone
        lines.append(f"- features: {b.get('embedding-dim')}-d embeddings of a frozen "
                     f"{b.get('backbone')} trained on {b.get('trained-on')}")
    if info.diverged:
        lines.append(f"- **the model diverged at round {info.diverged['round']}**: "
                     f"{info.diverged['cause']}; the rounds after it trained from a broken "
                     "model")
    if info.stopped_early:
        lines.append(f"- stopped early: {info.stopped_early}")
    if info.status in ("interrupted", "crashed", "failed"):
        lines.append(f"- **{info.status}**" + (f": {info.error}" if info.error else "")
                     + "; " + resume_hint(run.path))
    lines += failure_lines(records, info)
    if res:
        lines += outcome_lines(info, res, records)
    lines += ["", "![accuracy](plots/accuracy.png)", "", LOSS_LINE, ""]
    if (info.privacy or {}).get("mode") in ("local", "central", "distributed"):
        lines += ["![epsilon](plots/epsilon.png)", ""]
    if (run.path / "plots" / "exposure.png").exists():
        lines += ["![exposure](plots/exposure.png)", ""]
    if (run.path / "plots" / RELEASE_SCATTER).exists():  # drawn by the CLI after the run
        lines += [SCATTER_LINE, ""]
    if (run.path / "plots" / "label_distribution.png").exists():
        lines += ["![label distribution](plots/label_distribution.png)", ""]
    else:
        lines += ["The clients did not disclose their label histograms to the server; `fedpriv "
                  "run` draws the partitioner's ground truth as "
                  "`plots/label_distribution.png`.", ""]
    lines += ["Files: `config.toml` (resolved config), `metrics.jsonl` (one record per round), "
              "`partitions.json` (what clients disclosed about their partitions), `run.json` "
              "(status, timings, versions)"
              + (", `model.pt` (final global model)" if cfg.results.save_model else "") + ".", ""]
    run.write_text("summary.md", "\n".join(lines))


def embed_release_scatter(run_dir: Path) -> bool:
    """Add the release scatter to summary.md (after the loss plot), once: the CLI draws it
    after the ServerApp has written the page. True when it was added."""
    page = run_dir / "summary.md"
    if not (run_dir / "plots" / RELEASE_SCATTER).is_file() or not page.is_file():
        return False
    text = page.read_text()
    if SCATTER_LINE in text:
        return False
    if LOSS_LINE + "\n" in text:
        text = text.replace(LOSS_LINE + "\n", f"{LOSS_LINE}\n\n{SCATTER_LINE}\n", 1)
    else:
        text = text.rstrip("\n") + f"\n\n{SCATTER_LINE}\n"
    RunFolder(run_dir).write_text("summary.md", text)
    return True
