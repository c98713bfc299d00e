"""The message types the ServerApp sends and the ClientApp routes by (Flower's named actions).

Flower routes ``"<category>.<action>"`` to ``@app.<category>("<action>")``; the ClientApp
registers each handler from these constants (:func:`clients.app.handles`), so the two
sides cannot drift apart. Flower's own SecAgg+ workflow sends plain ``"train"``, so that
default action is the secure round's; ``"query"`` and ``"evaluate"`` are Flower's
``MessageType`` values.
"""

FIT = "train.fit"  # a plain training round (strategies.protocols.plain types its messages so)
SECURE_FIT = "train"  # a SecAgg+ round (Flower's SecAggPlusWorkflow)
CVAE_FIT = "train.cvae"  # phase 1 of the federated CVAE: train it, send back the decoder
DESCRIBE = "query"  # which partition a node holds (client discovery)
CVAE_RELEASE = "query.cvae_release"  # sample the release from the final shared decoder
EVALUATE = "evaluate"  # evaluate the global model on the client's own data
HE_FIT = "train.he"  # a round aggregated under homomorphic encryption: the update, encrypted
HE_HELLO = "query.he_hello"  # key setup: each client's X25519 public key
HE_DEAL = "query.he_deal"  # key setup: the dealer makes the CKKS key, sealed for each client
HE_INSTALL = "query.he_install"  # key setup: a client opens its sealed key
STATE_CHECK = "query.state"  # on a resume: what state each client kept (its DP ledger)
HE_DECRYPT = "query.he_decrypt"  # a key holder decrypts the aggregate (only the aggregate)

# Records the server adds to a message's content (strategies.grid.FederationGrid) and the
# ClientApp's assignment mod removes before any handler sees the message:
NODE_RECORD = "fedpriv.node"  # {"partition-id", "num-partitions", "state-dir"}: simulation
CELL_RECORD = "fedpriv.cell"  # {"cell": index, key: value...}: a sweep cell's config
STATE_DIR = "state-dir"  # node_config key: where a client keeps its state (clients.state_store)
DATA_PATH = "data-path"  # node_config key: a host's own data (tasks.local_data)
# node_config key: the host's operator agrees to take part in a malicious-server study
# (server = "malicious" sends this node trap weights); never set by the server
ACCEPT_TRAPS = "accept-trap-weights"
# node_config keys a real SuperNode reads instead of the run config's keys of the same
# name (clients.host_config): where the shared dataset lives, whether to download it, and
# the backbone weights file; the server's run config never names a path on a host
DATA_DIR = "data-dir"
DOWNLOAD = "download"
BACKBONE_WEIGHTS = "backbone-weights"
HE_STATE = "he-keys"  # Context.state record of the HE keys (never written to disk)
