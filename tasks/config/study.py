"""The privacy study's sections of the run config: what clients train on (raw inputs or
a frozen backbone's embeddings), how they anonymize it, and what the server observes and
attacks (the schema is read off these fields, as in :mod:`.sections`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from privacy.anonymize.density import OUTLIER_HANDLING
from privacy.anonymize.registry import ANONYMIZERS
from privacy.attacks.registry import ATTACKS, TRAPS

from ..registry import BACKBONES, DATASETS
from .keys import Section, key

FEATURES = ("raw", "embeddings")
INVERT_LABELS = ("recovered", "given")


@dataclass(frozen=True)
class EmbeddingsConfig(Section):
    GROUP = "embeddings"
    features: str = key("raw", "What clients train on: raw inputs, or embeddings from a "
                        "frozen backbone (then the model is a head: mlp or linear).",
                        choices=FEATURES)
    backbone: str = key("auto", "Frozen feature extractor for features = embeddings: a CNN "
                        "fedpriv trains on public data (cnn, small-cnn, resnet18), or "
                        "torchvision's ResNet-18 with backbone-weights. auto: resnet18 for "
                        "CIFAR or a weights file, else cnn.", choices=("auto",), registry=BACKBONES)
    backbone_weights: str = key("", "A torchvision ResNet-18 state-dict file (e.g. ImageNet "
                                "weights) to embed with. Empty: train a backbone on "
                                "backbone-data.")
    backbone_data: str = key("public-split", "What the backbone is trained on: public-split "
                             "(a share of the training set that no client gets) or another "
                             "dataset of the same input shape.",
                             choices=("public-split",), registry=DATASETS)
    public_fraction: float = key(0.2, "With backbone-data = public-split: the share of the "
                                 "training set reserved for the backbone.", lo=0, hi=1,
                                 lo_open=True, hi_open=True)
    embedding_dim: int = key(64, "Width of a trained backbone's embeddings.", lo=2)
    backbone_epochs: int = key(3, "Epochs to train the backbone (once; it is cached).", lo=0)

    @property
    def enabled(self) -> bool:
        return self.features == "embeddings"


@dataclass(frozen=True)
class AnonymizationConfig(Section):
    GROUP = "anonymization"
    anonymizer: str = key("none", "How each client anonymizes its embeddings before training "
                          "on them: ksame, density, cvae, cvae-online (a fresh CVAE sample "
                          "every epoch), cvae-federated, gaussian, laplace, random, mask, "
                          "pca, permutation, hashing, or identity (release as is, but "
                          "measure it).", registry=ANONYMIZERS)
    k: int = key(5, "ksame: group size.", lo=1)
    ksame_classwise: bool = key(False, "ksame: group within each class (k-Same-Select).")
    dbscan_eps: float = key(3.0, "density: DBSCAN neighbourhood radius on standardized "
                            "embeddings.", lo=0, lo_open=True)
    dbscan_min_samples: int = key(5, "density: DBSCAN core-point neighbours.", lo=1)
    density_outliers: str = key("merge", "density: DBSCAN outliers are dropped or merged into "
                                "the nearest cluster.", choices=OUTLIER_HANDLING)
    density_classwise: bool = key(False, "density: cluster within each class.")
    density_noise: float = key(0.0, "density: std of Gaussian noise added to released "
                               "centroids.", lo=0)
    noise_epsilon: float = key(1.0, "gaussian / laplace: per-record epsilon.", lo=0,
                               lo_open=True)
    noise_delta: float = key(0.0, "gaussian: per-record delta (0 = 1/(10 n)).", lo=0, hi=1,
                             hi_open=True)
    noise_clip: float = key(10.0, "gaussian / laplace: each vector is clipped to this L2 (L1) "
                            "norm, so the sensitivity is twice it.", lo=0, lo_open=True)
    noise_scale: float = key(0.5, "random: uniform noise of +-scale x feature std.", lo=0)
    mask_fraction: float = key(0.5, "mask: fraction of each vector's features set to zero.",
                               lo=0, hi=1, hi_open=True)
    pca_components: int = key(8, "pca: principal components kept.", lo=1)
    hash_salt: str = key("fedpriv", "hashing: the federation-wide salt of the feature hash.")
    cvae_latent: int = key(50, "cvae: latent dimension.", lo=1)
    cvae_hidden: int = key(256, "cvae: hidden width of encoder and decoder.", lo=1)
    cvae_beta: float = key(0.1, "cvae: weight of the KL term.", lo=0)
    cvae_epochs: int = key(200, "cvae: maximum epochs (early stopping on a 10% validation "
                           "split; fixed epochs with cvae-epsilon).", lo=1)
    cvae_patience: int = key(10, "cvae: epochs without validation improvement before "
                             "stopping.", lo=1)
    cvae_lr: float = key(0.001, "cvae: Adam learning rate.", lo=0, lo_open=True)
    cvae_batch_size: int = key(64, "cvae: batch size (the paper's 512 is for whole datasets; "
                               "per client 64 trains better: probe accuracy 0.86 vs 0.74 on "
                               "MNIST embeddings).", lo=1)
    cvae_epsilon: float = key(0.0, "cvae: train the CVAE with DP-SGD to this epsilon (Opacus, "
                              "accounted); 0 = no DP.", lo=0)
    cvae_clip: float = key(1.0, "cvae with cvae-epsilon: per-sample gradient clipping norm "
                           "of the DP-CVAE.", lo=0, lo_open=True)
    cvae_public_records: int = key(0, "cvae with cvae-epsilon: the public record count N the "
                                   "DP-CVAE's Poisson rate (B / N), steps (ceil(N / B) an "
                                   "epoch) and normaliser come from, so that cvae-epsilon "
                                   "holds for add/remove neighbours. 0 = the client's own n, "
                                   "treated as public: cvae-epsilon is then for replace-one "
                                   "neighbours.", lo=0)
    cvae_rounds: int = key(20, "cvae-federated: rounds in which clients train the CVAE "
                           "together (decoders averaged with FedAvg) before the head is "
                           "trained.", lo=1)
    cvae_local_epochs: int = key(5, "cvae-federated: local CVAE epochs per round.", lo=1)
    privacy_holdout: float = key(0.1, "Share of each client's data kept out of its release "
                                 "and training, to score distance-to-closest-record and "
                                 "membership inference.", lo=0, hi=1, hi_open=True)

    @property
    def enabled(self) -> bool:
        return self.anonymizer != "none"

    def params(self) -> Any:
        """The chosen anonymizer's parameters (its dataclass's fields are named after keys)."""
        cls = ANONYMIZERS.info(self.anonymizer).params
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class LeakageConfig(Section):
    GROUP = "leakage"
    leakage_rounds: str = key("", "Rounds in which the server keeps what it observes of the "
                              "clients (observations/) for the attacks: e.g. '1', '1,5', "
                              "'all'; empty: none.", allowed="round numbers, 'all', or empty")
    leakage_clients: str = key("0", "Which clients are observed: partition ids ('0', '0,3'), "
                               "'all', or 'aggregate' (the round's aggregate update: the only "
                               "choice under secure aggregation).",
                               allowed="partition ids, 'all' or 'aggregate'")
    attacks: str = key("labels,invert,mia", "Attacks run on the observations after the run "
                       "(and by `fedpriv attack`), by name: fedpriv's and those plugins "
                       "register.", registry=ATTACKS, listing=True)
    invert_iterations: int = key(2000, "Inverting Gradients: optimisation steps per restart.",
                                 lo=1)
    invert_restarts: int = key(8, "Inverting Gradients (and DLG): random restarts (the one "
                               "matching the update best is kept).", lo=1)
    invert_keep: int = key(2, "Inverting Gradients: with more restarts than this, every "
                           "restart runs the first 3/8 of the iterations and only this many, "
                           "the closest to the update, run on (successive halving).", lo=1)
    invert_lr: float = key(0.1, "Inverting Gradients: Adam's step size (decayed at 3/8, 5/8, "
                           "7/8).", lo=0, lo_open=True)
    invert_tv: float = key(0.01, "Inverting Gradients: weight of the total-variation prior.",
                           lo=0)
    invert_refine: int = key(2000, "Inverting Gradients on a one-example update: iterations "
                             "refining the best restart with the weaker invert-refine-tv prior "
                             "and 0.3x the step size, kept only if it matches the update "
                             "better (0: no refinement; batches are not refined).", lo=0)
    invert_refine_tv: float = key(0.001, "Inverting Gradients: the refinement's "
                                  "total-variation weight.", lo=0)
    dlg_iterations: int = key(300, "DLG: L-BFGS iterations per restart (restarts: "
                              "invert-restarts).", lo=1)
    feature_iterations: int = key(600, "imprint (the malicious server's trap): Adam steps "
                                  "inverting each recovered feature vector through the "
                                  "convolutional trunk (it converges in a few hundred).", lo=1)
    invert_labels: str = key("recovered", "Labels the inversion uses: recovered from the "
                             "update (iDLG / counts), or given (the attacker is told them).",
                             choices=INVERT_LABELS)
    invert_max_examples: int = key(64, "Skip inversion of updates made from more examples "
                                   "than this (the reconstruction would be meaningless and "
                                   "slow).", lo=1)
    observed_examples: int = key(0, "Observed clients train on only their first N examples "
                                 "(0: all of them): the user with a few images whom "
                                 "gradient-inversion studies attack; the other clients keep "
                                 "their whole partition.", lo=0)
    leakage_holdout: float = key(0.2, "Observed clients keep back this share of their "
                                 "records (when observed-examples is 0): the non-members, "
                                 "from their own distribution, that membership inference is "
                                 "scored on.", lo=0, hi=1, hi_open=True)
    mia_candidates: int = key(500, "Membership inference: at most this many members and as "
                              "many held-out non-members (unless mia-nonmembers says) are scored.",
                              lo=10)
    mia_nonmembers: int = key(0, "Membership inference: non-members scored (the observed "
                              "clients' held-out rows); 0: as many as members. TPR at 0.1% "
                              "FPR needs at least 1,000.", lo=0)
    reference_fraction: float = key(0.0, "Share of the training set the server keeps as its "
                                    "own auxiliary data (never a client's; same distribution)"
                                    ": the reference-model attacks (lira, rmia) train their "
                                    "reference updates on it. 0: none.", lo=0,
                                    hi=0.9)
    mia_references: int = key(16, "Reference-model attacks: reference updates simulated per "
                              "observation (online LiRA needs each candidate in and out of "
                              "at least two).", lo=2)
    server: str = key("honest", "The server's behaviour in the observed rounds: honest (it "
                      "only looks) or malicious (it sends trap weights, Fowl et al. 2022, "
                      "and recovers records even from a secure aggregate; the round's result "
                      "is then discarded). Malicious needs reference-fraction, imprint in "
                      "attacks (the attack that reads the trap) and a model with a linear "
                      "layer, a ReLU and a linear layer (mlp, cnn, small-cnn).",
                      choices=("honest", "malicious"))
    server_trap: str = key("binning", "server = malicious: the trap it sends. binning (Fowl "
                           "et al. 2022: every first-layer row equal, biases at quantiles of "
                           "its own data) or binning-disguised (the same bins, the rows made "
                           "to look unrelated on inputs constant over its data, to pass a "
                           "client's client-screen).", choices=TRAPS)
    canaries: int = key(0, "Audit: canaries (records with a crafted Dirac gradient on a "
                        "coordinate of their own, clipped and noised like any other) each "
                        "observed client inserts, each with probability 1/2; at most the "
                        "model's parameter count; thousands audit tightly (0 = no audit).",
                        lo=0)
    canary_clients: int = key(0, "Audit of central DP (dp = central, client-level): canary "
                              "clients the server adds (Andrew et al. 2024); each sends the "
                              "clipping norm times a random direction of its own in each "
                              "round it is sampled in; as many directions are held out. 0 = "
                              "none; 1,000 reach about 0.8x a claim of 8.", lo=0)
    audit_confidence: float = key(0.95, "Audit: joint confidence of the audit's bounds (the "
                                  "three estimators, every observation and the whole run; "
                                  "Bonferroni; canary-clients: its two bounds).", lo=0, hi=1,
                                  lo_open=True, hi_open=True)
    audit_guess_fraction: float = key(0.5, "Audit: share of canaries the auditor guesses on "
                                      "(the rest it abstains on), fixed before the run.", lo=0,
                                      hi=1, lo_open=True)
    prune_update: float = key(0.0, "Defence (Zhu et al. 2019): clients zero this share of "
                              "their update's smallest-magnitude entries before sending it.",
                              lo=0, hi=1, hi_open=True)

    # What `fedpriv attack` may change after the run; the rest are facts of the run.
    # What may change after the run (the audit's confidence and guess share are fixed
    # before it: choosing them after seeing the scores would void the bound); plugins, to
    # run an attack a plugin registers on a run made without it.
    ATTACK_SETTINGS = ("plugins", "attacks", "invert-iterations", "invert-restarts",
                       "invert-lr", "invert-tv", "invert-keep", "invert-refine",
                       "invert-refine-tv", "dlg-iterations", "invert-labels",
                       "invert-max-examples", "mia-candidates", "mia-nonmembers",
                       "mia-references")

    def rounds(self, num_rounds: int) -> list[int]:
        """The observed rounds."""
        text = self.leakage_rounds.strip()
        if text == "all":
            return list(range(1, num_rounds + 1))
        return sorted({int(r) for r in text.split(",") if r.strip()})

    def clients(self, num_clients: int) -> list[int] | None:
        """Observed partition ids; None for the aggregate."""
        text = self.leakage_clients.strip()
        if text == "aggregate":
            return None
        if text == "all":
            return list(range(num_clients))
        return sorted({int(c) for c in text.split(",") if c.strip()})

    def attack_list(self) -> list[str]:
        return [a.strip() for a in self.attacks.split(",") if a.strip()]

    @property
    def enabled(self) -> bool:
        return bool(self.leakage_rounds.strip())


@dataclass(frozen=True)
class MemorizationConfig(Section):
    """The Secret Sharer (Carlini et al. 2019) on federated training (Thakkar et al. 2020):
    canary lines planted in chosen clients' text, their exposure in the global model."""

    GROUP = "memorization"
    secret_canaries: int = key(0, "Canaries (the line 'my secret number is ' and random "
                               "digits) planted in clients' text; the server measures each "
                               "one's exposure in the global model after every round (text "
                               "datasets; 0 = none).", lo=0, hi=100)
    secret_repetitions: str = key("1,10,100", "How often a holder repeats a canary line: "
                                  "canaries are dealt to these counts in turn.",
                                  allowed="positive integers, comma-separated")
    secret_clients: int = key(1, "Clients holding each canary (each plants all its "
                              "repetitions), drawn with the seed from all clients.", lo=1)
    secret_length: int = key(6, "Digits of each secret: the candidate space is 10^length "
                             "(exposure at most log2 of it); ranked exactly up to 10^4, "
                             "extrapolated from sampled candidates above (Carlini et al. "
                             "section 4.3).", lo=1, hi=12)
    secret_samples: int = key(1000, "Random candidates each extrapolated exposure is "
                              "fitted to.", lo=50)

    @property
    def enabled(self) -> bool:
        return self.secret_canaries > 0

    def repetitions(self) -> list[int]:
        """The repetition counts, in order (raises ValueError on a bad list)."""
        counts = [int(r) for r in self.secret_repetitions.split(",") if r.strip()]
        if not counts or min(counts) < 1:
            raise ValueError("give positive integers, e.g. '1,10,100'")
        return counts
