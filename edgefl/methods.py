"""Methods by name: each is a client half, a server half, an options model and its traits.

A :class:`MethodSpec` is the one place a method declares what the runners, the assignment and the
tests need to know about it (what a client uploads, whether the method is one-shot, whether its
server uses late reports, whether it takes generator clients). Nothing else keeps lists of
method names.

Halves and options are named by import path ("module:Class") and imported only when used, so
importing this module (the config does, to validate a method name) pulls in neither torch
training code nor ``edgefl.server``: a device never imports server code. A leaf module: it imports
nothing of edgefl but the error types.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from edgefl.errors import ConfigError


@dataclass(frozen=True)
class MethodSpec:
    name: str
    description: str
    client_path: str  # "module:Class" of the client half (a ClientHalf)
    server_path: str  # "module:Class" of the server half (a ServerHalf)
    options_path: str  # "module:Class" of the options model (a MethodOptions)
    #: message kinds a client may upload (edgefl.messages.MESSAGE_KINDS); anything else is refused
    #: before the server half sees it
    uploads: tuple[str, ...] = ("status",)
    #: message kinds the server sends in a round's download
    downloads: tuple[str, ...] = ()
    #: exactly one round (FedMHO, FedCVAE-Ens)
    one_shot: bool = False
    #: the server half uses reports from rounds that already closed (FedHe's knowledge store)
    asynchronous: bool = False
    #: devices may train a generator instead of a classifier (FedMHO's CVAE clients)
    generator_clients: bool = False
    #: why the server cannot take only the sum of the uploads (secure aggregation refuses the
    #: method with it); empty: the server only sums what devices send, so it can be secured
    needs_individual_uploads: str = ""
    #: (option, value) with which the server only sums after all (FedIN without IN training sends no pairs)
    sums_with_option: tuple[str, Any] | None = None

    def _load(self, path: str, what: str) -> Any:
        """The class ``path`` ("module:Class") names; a ConfigError naming the method and the spec's
        field when it cannot be imported (a plug-in's typo), never a traceback."""
        module, sep, attr = path.partition(":")
        try:
            if not sep or not module or not attr:
                raise ValueError(f"{path!r} is not \"module:Class\"")
            return getattr(importlib.import_module(module), attr)
        except Exception as exc:
            raise ConfigError(f"method {self.name!r}: its {what} {path!r} cannot be imported: {type(exc).__name__}: {exc}",
                              hint=f"fix the MethodSpec's {what} where {self.name!r} is registered (register_method); "
                                   "a plug-in's modules must be importable on this machine") from None

    @property
    def options_model(self) -> Any:
        return self._load(self.options_path, "options_path")

    def client_class(self) -> Any:
        return self._load(self.client_path, "client_path")

    def server_class(self) -> Any:
        return self._load(self.server_path, "server_path")

    def parse_options(self, raw: dict) -> Any:
        return self.options_model.model_validate(raw)


METHODS: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    """Add a method (docs/adding-a-method.md); a name can be registered once."""
    if spec.name in METHODS and METHODS[spec.name] != spec:
        raise ValueError(f"method {spec.name!r} is already registered")
    METHODS[spec.name] = spec
    return spec


for _spec in (
    MethodSpec(
        "local",
        "Local-only training: no communication (the 'Private' / SOLO baseline)",
        "edgefl.algorithms.local:LocalClient",
        "edgefl.server.methods.local:LocalServer",
        "edgefl.algorithms.local:LocalOptions",
        uploads=("status",), needs_individual_uploads="local-only shares nothing: there is no sum to secure",
    ),
    MethodSpec(
        "fedavg",
        "FedAvg; heterogeneous fleets average within groups of the same architecture",
        "edgefl.algorithms.fedavg:FedAvgClient",
        "edgefl.server.methods.fedavg:FedAvgServer",
        "edgefl.algorithms.fedavg:FedAvgOptions",
        uploads=("weights",), downloads=("weights",),
    ),
    MethodSpec(
        "fedhe",
        "FedHe (Chan & Ngai, MSN 2021): per-class logit exchange, asynchronous server",
        "edgefl.algorithms.fedhe:FedHeClient",
        "edgefl.server.methods.fedhe:FedHeServer",
        "edgefl.algorithms.fedhe:FedHeOptions",
        uploads=("class_logits",), downloads=("class_logits",), asynchronous=True,
    ),
    MethodSpec(
        "fedin",
        "FedIN (Chan, Jiang, Deng & Ngai): feature-pair IN training, gradient alleviation, proximal term, layer-wise aggregation",
        "edgefl.algorithms.fedin:FedINClient",
        "edgefl.server.methods.fedin:FedINServer",
        "edgefl.algorithms.fedin:FedINOptions",
        uploads=("weights",), downloads=("weights",),
        needs_individual_uploads="FedIN's server trains on each device's feature pairs (pairs.s_in / pairs.s_out), which cannot be "
                                 "summed: set method.in_training = false (FedIN without IN: weights only, aggregated layer-wise), "
                                 "or use FedAvg",
        sums_with_option=("in_training", False),
    ),
    MethodSpec(
        "felo",
        "Felo (paper 000): per-class mid-level features and logits, same-architecture weight averaging",
        "edgefl.algorithms.felo:FeloClient",
        "edgefl.server.methods.felo:FeloServer",
        "edgefl.algorithms.felo:FeloOptions",
        uploads=("class_features",), downloads=("class_features",),
    ),
    MethodSpec(
        "velo",
        "Velo (paper 000): Felo with a server-side conditional VAE generating per-class features",
        "edgefl.algorithms.felo:FeloClient",
        "edgefl.server.methods.felo:VeloServer",
        "edgefl.algorithms.felo:VeloOptions",
        uploads=("class_features",), downloads=("class_features",),
        needs_individual_uploads="Velo's server trains its CVAE on each device's features, which a sum cannot give; "
                                 "Felo (method.name = \"felo\") shares the same per-class knowledge and can be secured",
    ),
    *(
        MethodSpec(
            name, description, "edgefl.algorithms.fedmho:FedMHOClient", "edgefl.server.methods.fedmho:FedMHOServer",
            f"edgefl.algorithms.fedmho:{options}", uploads=("weights", "decoder"), downloads=("weights",),
            one_shot=True, generator_clients=True,
            needs_individual_uploads="FedMHO's server samples from each device's CVAE decoder, which cannot be summed; "
                                     "a secured run of classifiers alone is FedAvg (method.name = \"fedavg\")",
        )
        for name, options, description in (
            ("fedmho", "FedMHOOptions", "FedMHO (Yao et al.): one-shot; classifier clients + CVAE-decoder clients, server "
                                        "generation, K-means filtering, fusion (fusion = ce|md|sd)"),
            ("fedmho-md", "FedMHOMDOptions", "FedMHO-MD: FedMHO with KL to the classifier clients' mean logits (fusion = md)"),
            ("fedmho-sd", "FedMHOSDOptions", "FedMHO-SD: FedMHO with KL to the initial (averaged) global model (fusion = sd)"),
        )
    ),
    MethodSpec(
        "fedcvae",
        "FedCVAE-Ens (Heinbaugh et al.): one-shot; every client uploads a CVAE decoder, the server trains a classifier from scratch",
        "edgefl.algorithms.fedmho:FedMHOClient",
        "edgefl.server.methods.fedmho:FedCVAEServer",
        "edgefl.algorithms.fedmho:FedCVAEOptions",
        uploads=("decoder",), one_shot=True, generator_clients=True,
        needs_individual_uploads="FedCVAE-Ens samples from each device's CVAE decoder, which cannot be summed; "
                                 "for a secured run train classifiers with FedAvg or FedHe instead",
    ),
    MethodSpec(
        "chfl",
        "CHFL (Liu et al.): private backbones, shared E x C head, decoupled KD at a decaying temperature",
        "edgefl.algorithms.chfl:CHFLClient",
        "edgefl.server.methods.chfl:CHFLServer",
        "edgefl.algorithms.chfl:CHFLOptions",
        uploads=("head",), downloads=("head",),
    ),
):
    register_method(_spec)


def get_method(name: str) -> MethodSpec:
    """The method registered as ``name``, the plug-ins' included (edgefl.plugins)."""
    if name not in METHODS:
        from edgefl.plugins import load_plugins

        load_plugins()
    try:
        return METHODS[name]
    except KeyError:
        import difflib

        from edgefl.plugins import unknown_hint

        close = difflib.get_close_matches(name.lower(), list(METHODS), n=1, cutoff=0.7)  # 'fedprox' is not 'fedmho' (0.62)
        hint = f"did you mean {close[0]!r}?" if close else f"methods: {', '.join(METHODS)}"
        raise ConfigError(f"unknown method {name!r}", hint=hint + unknown_hint("method", name)) from None
