"""Methods by name: each is a client half, a server half and an options model.

Server halves live in the top-level ``server/`` folder (``edgefl.server.methods``) and are
imported only when a server is built, so a device never imports server code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from edgefl.algorithms.base import ClientHalf, MethodOptions
from edgefl.errors import ConfigError


@dataclass(frozen=True)
class MethodSpec:
    name: str
    description: str
    client_path: str  # "module:Class"
    server_path: str
    options_path: str

    @staticmethod
    def _load(path: str):
        module, attr = path.split(":")
        return getattr(importlib.import_module(module), attr)

    @property
    def options_model(self) -> type[MethodOptions]:
        return self._load(self.options_path)

    def client_class(self) -> type[ClientHalf]:
        return self._load(self.client_path)

    def server_class(self):
        return self._load(self.server_path)

    def parse_options(self, raw: dict) -> MethodOptions:
        return self.options_model.model_validate(raw)


METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec(
            "local",
            "Local-only training: no communication (the 'Private' / SOLO baseline)",
            "edgefl.algorithms.local:LocalClient",
            "edgefl.server.methods.local:LocalServer",
            "edgefl.algorithms.local:LocalOptions",
        ),
        MethodSpec(
            "fedavg",
            "FedAvg; heterogeneous fleets average within groups of the same architecture",
            "edgefl.algorithms.fedavg:FedAvgClient",
            "edgefl.server.methods.fedavg:FedAvgServer",
            "edgefl.algorithms.fedavg:FedAvgOptions",
        ),
        MethodSpec(
            "fedhe",
            "FedHe (Chan & Ngai, MSN 2021): per-class logit exchange, asynchronous server",
            "edgefl.algorithms.fedhe:FedHeClient",
            "edgefl.server.methods.fedhe:FedHeServer",
            "edgefl.algorithms.fedhe:FedHeOptions",
        ),
        MethodSpec(
            "fedin",
            "FedIN (Wang et al.): feature-pair IN training, gradient alleviation, proximal term, layer-wise aggregation",
            "edgefl.algorithms.fedin:FedINClient",
            "edgefl.server.methods.fedin:FedINServer",
            "edgefl.algorithms.fedin:FedINOptions",
        ),
        MethodSpec(
            "felo",
            "Felo (paper 000): per-class mid-level features and logits, same-architecture weight averaging",
            "edgefl.algorithms.felo:FeloClient",
            "edgefl.server.methods.felo:FeloServer",
            "edgefl.algorithms.felo:FeloOptions",
        ),
        MethodSpec(
            "velo",
            "Velo (paper 000): Felo with a server-side conditional VAE generating per-class features",
            "edgefl.algorithms.felo:FeloClient",
            "edgefl.server.methods.felo:VeloServer",
            "edgefl.algorithms.felo:VeloOptions",
        ),
        MethodSpec(
            "fedmho",
            "FedMHO (Yao et al.): one-shot; classifier clients + CVAE-decoder clients, server generation, K-means filtering, fusion (fusion = ce|md|sd)",
            "edgefl.algorithms.fedmho:FedMHOClient",
            "edgefl.server.methods.fedmho:FedMHOServer",
            "edgefl.algorithms.fedmho:FedMHOOptions",
        ),
        MethodSpec(
            "fedmho-md",
            "FedMHO-MD: FedMHO with KL to the classifier clients' mean logits (fusion = md)",
            "edgefl.algorithms.fedmho:FedMHOClient",
            "edgefl.server.methods.fedmho:FedMHOServer",
            "edgefl.algorithms.fedmho:FedMHOMDOptions",
        ),
        MethodSpec(
            "fedmho-sd",
            "FedMHO-SD: FedMHO with KL to the initial (averaged) global model (fusion = sd)",
            "edgefl.algorithms.fedmho:FedMHOClient",
            "edgefl.server.methods.fedmho:FedMHOServer",
            "edgefl.algorithms.fedmho:FedMHOSDOptions",
        ),
        MethodSpec(
            "fedcvae",
            "FedCVAE-Ens (Heinbaugh et al.): one-shot; every client uploads a CVAE decoder, the server trains a classifier from scratch",
            "edgefl.algorithms.fedmho:FedMHOClient",
            "edgefl.server.methods.fedmho:FedCVAEServer",
            "edgefl.algorithms.fedmho:FedCVAEOptions",
        ),
        MethodSpec(
            "chfl",
            "CHFL (Liu et al.): private backbones, shared E x C head, decoupled KD at a decaying temperature",
            "edgefl.algorithms.chfl:CHFLClient",
            "edgefl.server.methods.chfl:CHFLServer",
            "edgefl.algorithms.chfl:CHFLOptions",
        ),
    )
}


def get_method(name: str) -> MethodSpec:
    try:
        return METHODS[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, list(METHODS), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"methods: {', '.join(METHODS)}"
        raise ConfigError(f"unknown method {name!r}", hint=hint) from None
