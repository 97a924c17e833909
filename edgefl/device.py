"""The device loop: a method's client half behind a transport (what a Pi runs, and what every
simulated device runs in-process).

It acts on what the server sends:

* ``download`` for round r: "you are selected in round r, here is what the server sends you".
  The device trains, then uploads (in chunks when large) and keeps the upload until the server
  answers it; the download's ``info.evaluate`` asks for the accuracy of the trained model in
  the upload's ``meta.eval_accuracy``. A second copy of a download is ignored; a new download
  for a round already served (a restarted server reopening it) is answered with the same upload.
* ``evaluate``: "load this (the global model) and tell me its accuracy on your data"; answered
  with an upload of kind ``evaluation``.
* ``ack`` / ``nack`` of an upload: done with it; a nack listing missing chunks gets only those
  chunks again. An upload left unanswered is resent with growing back-off (:meth:`tick`).
* the round announcement: the run is done when it says so.

Blocking (:meth:`run`), the device reads every delivery at hand before it trains: of several
downloads that waited for it (queued in its session while it was offline, then delivered at
once on reconnect) it trains only the newest and skips the rest, which the server has moved past.

With a :class:`~edgefl.device_state.DeviceStateStore` the device saves its model, what its
method carries and the upload after every round it trains, and starts from them again after a
crash (:meth:`restore`): the server resends the download of the round it is waiting for, and
the device answers with the saved upload or retrains that round from the saved state. The saved
state is applied only when the server's first message names the run that saved it (``info.run``):
a new run of the same config starts afresh.

The loop is event-driven (:meth:`handle` one delivery, :meth:`tick` for resends) so the same code
runs blocking over MQTT (:meth:`run`) and stepped by the simulation's in-memory network.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from edgefl.algorithms import ClientHalf
from edgefl.config import NetworkSettings
from edgefl.device_state import DeviceStateStore
from edgefl.errors import EdgeflError, PayloadError
from edgefl.filters import Filter
from edgefl.messages import Message, decode, encode
from edgefl.transport.base import Delivery, DeviceTransport
from edgefl.transport.chunks import Reassembler, split
from edgefl.transport.envelope import Envelope, pack, tensor_manifest, unpack
from edgefl.transport.signing import EVERYONE, Verifier
from edgefl.transport.topics import is_safe_name
from edgefl.safetext import printable
from edgefl.seeding import GLOBAL_RNG_LOCK
from edgefl.tensorchecks import bounded_problem, nonfinite_problem

FILTER_STATE = "filter."  # prefix of the filters' tensors in a device's saved state
MAX_SEEN_IDS = 10_000  # signed server message ids remembered to refuse replays
REFUSALS_LOGGED = 20  # refusals a minute logged one by one; the rest are counted
SETTLE_S = 0.3  # the quiet a device waits for after a download before training it (see run())
DRAIN_MAX_S = 2.0  # the longest a device reads on before it trains what it holds and resends (see run())

log = logging.getLogger("edgefl.device")


@dataclass
class WorkDone:
    """What the device did for one download (the simulation's virtual clock prices it)."""

    round: int
    samples: int
    bytes_up: int
    bytes_down: int


@dataclass
class _Pending:
    upload: Envelope
    pieces: list[bytes]
    sent_at: float
    wait_s: float

    def chunk_ids(self, max_bytes: int) -> set[str]:
        """The ids of this upload's chunks (a nack of one chunk replies to its id)."""
        return {unpack(piece, max_bytes).message_id for piece in self.pieces} if len(self.pieces) > 1 else set()


class DeviceLoop:
    def __init__(self, client: ClientHalf, transport: DeviceTransport, federation: str, network: NetworkSettings,
                 x_test: torch.Tensor | None = None, y_test: torch.Tensor | None = None, eval_batch_size: int = 1000,
                 state: DeviceStateStore | None = None, verifier: Verifier | None = None,
                 filters: list[Filter] | None = None) -> None:
        self.client = client
        self.device = client.client_id
        self.transport = transport
        self.federation = federation
        self.net = network
        self.x_test, self.y_test = x_test, y_test
        self.eval_batch_size = eval_batch_size
        self.reassembler = Reassembler(network.max_message_bytes, network.stale_upload_s, max_age_s=network.partial_age_limit_s())
        self.handled: set[str] = set()  # download / evaluate message ids already acted on
        self.served: dict[int, Envelope] = {}  # round -> the upload sent for it (the last two rounds)
        self.pending: dict[str, _Pending] = {}  # upload id -> waiting for its ack
        self.latest_round = 0
        self.finished = False
        self.results: dict[int, dict[str, Any]] = {}
        self.last_work: WorkDone | None = None
        #: told a line for each upload the server acknowledged (a device's journal shows every round); None: quiet
        self.on_answer: Callable[[str], None] | None = None
        self.state = state
        self.resumed_from: int | None = None  # the round whose saved state this loop continued from
        #: whether an upload said where this device started from (a first upload from scratch says so,
        #: PROTOCOL.md 4.3); a simulation's checkpoint keeps it, so a resumed run's uploads are the same bytes
        self.start_told = False
        self._saved: tuple[int, str | None, dict[str, torch.Tensor], bytes] | None = None  # loaded, not yet applied
        self.run_id: str | None = None  # the server's run id (info.run), once a message named it
        #: set by a simulation that trains several devices' downloads together: called with a
        #: download; True means it took it and will call :meth:`complete` with the trained upload
        self.fit_later: Callable[[DeviceLoop, Envelope], bool] | None = None
        #: set by a simulation that fuses clients trained in an earlier run (simulation.clients_from):
        #: round -> (the client half's upload, its state after training), used instead of training
        self.replay: dict[int, tuple[Message, dict[str, torch.Tensor]]] | None = None
        #: set by a simulation that keeps its clients (simulation.keep_clients): round -> the client
        #: half's upload, before the upload filters
        self.kept: dict[int, Message] | None = None
        #: the server's public key: unsigned, misaddressed or wrongly signed server messages are refused
        self.verifier = verifier
        self._seen_signed: OrderedDict[str, None] = OrderedDict()  # ids of signed server messages (replays refused)
        #: the device side of the configured filter chain: downloads in (reversed), uploads out (in order)
        self.filters = list(filters or [])
        self.refused = 0  # server messages refused (malformed, unsigned, out of bounds...)
        #: set by :meth:`run`: a checked download waits here until the deliveries at hand are read
        self._defer_training = False
        self._waiting: tuple[Envelope, Message | None] | None = None
        self.skipped: list[int] = []  # rounds whose download a newer one overtook (not trained)
        self._refusal_window = [-math.inf, 0]  # [start of the minute, refusals in it]
        self._nack_window = [-math.inf, 0]  # the same for the server's refusals that answer no upload of ours

    def restore(self) -> int | None:
        """Load the saved state, when there is one (returns its round; None: none). It is applied
        when the server's first message shows the same run, else dropped (:meth:`_adopt_run`)."""
        if self.state is None:
            return None
        self._saved = self.state.load()
        return None if self._saved is None else self._saved[0]

    @staticmethod
    def _run_of(env: Envelope) -> str | None:
        info = env.extra.get("info")
        return info.get("run") if isinstance(info, dict) and isinstance(info.get("run"), str) else None

    def _adopt_run(self, env: Envelope) -> None:
        """The server's run, from any message naming it except a final announcement (that may be
        the retained end of an earlier run); the saved state is applied or dropped then."""
        run = self._run_of(env)
        if run is None or run == self.run_id or (env.type == "round" and env.extra.get("info", {}).get("done")):
            return
        self.run_id = run
        if self._saved is None:
            return
        round_no, saved_run, tensors, upload = self._saved
        self._saved = None
        if saved_run != run:
            # said once: the store moves the files aside (and says where) when this run's first round is saved
            log.info("%s: the saved state is from another run (%s), not used", self.device, saved_run)
            return
        self.load_carry_state(tensors)
        self.served[round_no] = unpack(upload, self.net.max_message_bytes)
        self.latest_round = max(self.latest_round, round_no)
        self.resumed_from = round_no
        log.warning("%s: continuing from the state it saved after round %d", self.device, round_no)

    # --- incoming -----------------------------------------------------------------------------
    def handle(self, item: Delivery) -> None:
        """Act on one delivery. Never raises on what the network brings: bad input (a malformed,
        unsigned or out-of-bounds envelope, chunk or message body, wherever it shows) is logged
        and dropped, and the device goes on."""
        self._guarded(lambda: self._handle(item), item.where or f"the {item.channel} channel")  # (a simulation has no topics)

    def _guarded(self, act: Callable[[], None], where: str) -> None:
        try:
            act()
        except PayloadError as exc:
            self.refused += 1
            if self._loud():
                log.warning("%s: refusing a message on %s: %s", self.device, printable(where, 120), printable(str(exc)))
        except Exception:  # a case no check foresaw: the device must outlive any message
            self.refused += 1
            if self._loud():
                log.exception("%s: could not act on a message on %s; ignored", self.device, printable(where, 120))

    def _loud(self) -> bool:
        """Whether a refusal gets its own log line: the first REFUSALS_LOGGED in each minute do,
        the rest are counted in one line when the minute is over (a flood of forgeries must not
        fill a Pi's log or block on a slow one)."""
        return self._budget(self._refusal_window, f"messages refused ({self.refused} refused in all)")

    def _budget(self, window: list, what: str) -> bool:
        """The first REFUSALS_LOGGED lines of each minute in ``window`` are logged; the rest are
        counted in one line when the minute is over."""
        now = self.transport.now()
        if now - window[0] >= 60.0:
            quiet = window[1] - REFUSALS_LOGGED
            if quiet > 0:
                log.warning("%s: %d more %s in the last minute, not shown one by one", self.device, quiet, what)
            window[0], window[1] = now, 0
        window[1] += 1
        return window[1] <= REFUSALS_LOGGED

    def _verify(self, item: Delivery) -> None:
        """With the server's key: the message must be signed by it, for this device (or everyone,
        on the announcement channel), and not seen before."""
        assert self.verifier is not None
        announcement = item.channel == "announcement"
        header = self.verifier.verify(item.payload, EVERYONE if announcement else self.device)
        if not announcement and header.get("to") != self.device:
            raise PayloadError("a message for everyone on this device's own topic: refused")
        message_id = header.get("message_id")
        if not announcement and isinstance(message_id, str):
            if message_id in self._seen_signed:
                raise PayloadError(f"replay of server message {printable(message_id, 64)} refused")
            self._seen_signed[message_id] = None
            while len(self._seen_signed) > MAX_SEEN_IDS:
                self._seen_signed.popitem(last=False)

    def _handle(self, item: Delivery) -> None:
        if self.verifier is not None:
            self._verify(item)
        env = unpack(item.payload, self.net.max_message_bytes)
        if env.sender != "server":
            log.warning("%s: ignoring a message from %r", self.device, printable(env.sender, 64))
            return
        if env.federation != self.federation:
            raise PayloadError(f"a message of federation {printable(env.federation, 64)!r}, not {self.federation!r}")
        self._adopt_run(env)
        if item.channel == "announcement":
            self._announcement(env)
            return
        if env.type == "chunk":
            whole = self.reassembler.add(env)
            if whole is None:
                return
            # a whole rebuilt from chunks that each verified is the server's (no signature of its own)
            env = unpack(whole, self.net.max_message_bytes)
            if env.sender != "server" or env.federation != self.federation:
                raise PayloadError("a chunked message that is not the server's of this federation")
            self._adopt_run(env)
        if env.type == "download":
            self._serve(env)
        elif env.type == "evaluate":
            self._evaluate(env)
        elif env.type == "stage":
            self._stage(env)
        elif env.type in ("ack", "nack") and env.reply_to:
            self._answered(env)
        elif env.type == "nack":  # the server could not tell which message it refuses (often not ours: a forgery on our topic)
            if self._budget(self._nack_window, "refusals from the server"):
                log.warning("%s: the server refused a message: %s", self.device, printable(str(env.extra.get("reason")), 300))

    def _announcement(self, env: Envelope) -> None:
        run = self._run_of(env)
        if not env.extra.get("info", {}).get("done"):
            self.latest_round = max(self.latest_round, env.round)
            return
        if run is not None and run != self.run_id:
            # the retained end of a run this device never took part in (an earlier run of the same
            # federation): the server of the next run replaces it when it starts
            log.warning("%s: the announced run %s is over and this device took no part in it; waiting for the "
                        "server's next run (--timeout ends the wait)", self.device, run)
            return
        self.finished = True

    # --- acting ---------------------------------------------------------------------------------
    def downlink(self, env: Envelope) -> Message | None:
        """The message a download or evaluate request carries, checked before anything uses it:
        its fields against its envelope, every value finite and within ``max_abs_value``, and
        the method's own expectations (names, dtypes, shapes; :meth:`ClientHalf.downlink_problem`)."""
        if env.codec != "safetensors":
            return None
        message = decode(env.body, self.net.max_message_bytes)
        if message.sender != "server":
            raise PayloadError(f"the message inside names sender {printable(message.sender, 64)!r}, not the server")
        for f in reversed(self.filters):  # the server applied them in order: undo in reverse
            message = f.download_in(message)
        problem = bounded_problem(message.tensors, self.net.max_abs_value) or self.client.downlink_problem(message)
        if problem:
            raise PayloadError(f"the server's {env.type} for round {env.round} is not one this device can use: {problem}")
        return message

    def _serve(self, env: Envelope) -> None:
        if env.message_id in self.handled:
            return
        r = env.round
        if r in self.served:  # trained already: the same upload, same id (a duplicate is harmless)
            self.handled.add(env.message_id)
            self._send(self.served[r])
            return
        downlink = self.downlink(env)  # refused here (PayloadError) before it is marked handled: a good copy may follow
        self.handled.add(env.message_id)
        if self.fit_later is not None and self.replay is None and self.fit_later(self, env):
            return  # the simulation trains this download with others, then calls complete()
        if self._defer_training:
            self._hold(env, downlink)
            return
        self.complete(env, self.fit(env, downlink))

    def _hold(self, env: Envelope, downlink: Message | None) -> None:
        """Keep the newest download until the deliveries at hand are read (:meth:`run`). Rounds
        (and asynchronous work numbers) only grow: an older download than one in hand is work
        the server has moved past, and training it would only delay the current one."""
        if self._waiting is not None:
            held = self._waiting[0]
            older, self._waiting = (held, (env, downlink)) if env.round >= held.round else (env, self._waiting)
            self.skipped.append(older.round)
            log.warning("%s: skipping the download of round %d: the download of round %d came with it (it waited "
                        "while this device was away, and the server has moved on)", self.device, older.round,
                        self._waiting[0].round)
            return
        self._waiting = (env, downlink)

    def train_waiting(self) -> None:
        """Train the download kept by :meth:`_hold`, if any (errors refused as :meth:`handle` does)."""
        if self._waiting is None:
            return
        env, downlink = self._waiting
        self._waiting = None
        self._guarded(lambda: self.complete(env, self.fit(env, downlink)), f"download of round {env.round}")

    def fit(self, env: Envelope, downlink: Message | None = None) -> Message:
        """Run the client half on one download: what it shares. Whatever the download held, the
        model never leaves this call non-finite: a training that ends so (or fails) is undone and
        the download refused."""
        downlink = self.downlink(env) if downlink is None else downlink
        if self.replay is not None and env.round in self.replay:  # trained in an earlier run: its upload and model
            message, trained = self.replay[env.round]
            self.client.load_carry_state(trained)
            return message
        before = self.client.carry_state()
        try:
            with GLOBAL_RNG_LOCK:  # a round's dropout masks come from the global RNG, seeded as the training starts
                message = self.client.fit(downlink, env.round)
            if message is None:  # a client half with nothing to share still reports that it trained
                message = self.client.reply("status", env.round, {})
            problem = nonfinite_problem(self.client.model.state_dict(), "the model after training") \
                or nonfinite_problem(message.tensors, "the upload")
        except (RuntimeError, ValueError, IndexError, KeyError, TypeError, PayloadError) as exc:
            problem = f"training on it failed: {type(exc).__name__}: {str(exc)[:200]}"
        if problem:
            self.client.load_carry_state(before)
            self.handled.discard(env.message_id)
            raise PayloadError(f"round {env.round}: the model was restored and the download refused ({problem})")
        return message

    def complete(self, env: Envelope, message: Message) -> None:
        """Answer a download with what training it made: keep the upload, save, send."""
        r = env.round
        if self.kept is not None:
            self.kept[r] = message
        upload = self.served[r] = self.package(env, message)
        for old in [k for k in self.served if k < r - 1]:
            del self.served[old]
        if self.state is not None:  # before sending: a crash after the send resends this very upload
            try:
                self.state.save(r, self.run_id, self.carry_state(), pack(upload))
            except EdgeflError as exc:  # the state only serves a restart: the round's upload still goes
                log.warning("%s: round %d: %s (hint: %s); the upload is sent, but a crash now would lose this round",
                            self.device, r, exc.message, exc.hint)
        self._send(upload)

    def package(self, env: Envelope, message: Message) -> Envelope:
        """The upload answering ``env``: ``message`` (with the accuracy when asked), encoded."""
        if env.extra.get("info", {}).get("evaluate") and self.client.judged:
            # a new message: what the client half returned stays as it made it
            message = Message(message.kind, message.round, message.sender, message.tensors,
                              {**message.meta, "eval_accuracy": self._accuracy()}, message.message_id)
        if not self.start_told:
            # the server can then tell a device that restarted from scratch mid-run (its accuracy
            # drops while its model catches up); one that went on from its saved state says nothing,
            # as it would not have had it never stopped (a resumed run's bytes are an uninterrupted run's)
            self.start_told = True
            if self.resumed_from is None:
                start: dict[str, Any] = {"started_from": "scratch"}
                if self.state is not None and self.state.lost:
                    start["state_lost"] = self.state.lost[:250]
                message = Message(message.kind, message.round, message.sender, message.tensors, {**message.meta, **start},
                                  message.message_id)
        for f in self.filters:
            message = f.upload_out(message)
        body = encode(message)
        self.last_work = WorkDone(env.round, self.client.last_train_samples, len(body), len(env.body))
        return Envelope("upload", self.federation, env.round, self.device, body, message.message_id,
                        model_version=env.model_version, codec="safetensors", extra={"tensors": tensor_manifest(message.tensors)})

    def _accuracy(self) -> float:
        return self.client.evaluate(self.x_test, self.y_test, self.eval_batch_size)

    def _evaluate(self, env: Envelope) -> None:
        if env.message_id in self.handled:
            return
        downlink = self.downlink(env)
        self.handled.add(env.message_id)
        before = self.client.carry_state()
        try:
            self.client.receive(downlink)
        except (RuntimeError, ValueError, IndexError, KeyError, TypeError, PayloadError) as exc:
            self.client.load_carry_state(before)
            raise PayloadError(f"an evaluate request the model cannot take: {type(exc).__name__}: {str(exc)[:200]}") from None
        meta = {"num_samples": self.client.num_test_samples(self.y_test), "eval_accuracy": self._accuracy()}
        message = Message("evaluation", env.round, self.device, {}, meta)
        self._send(Envelope("upload", self.federation, env.round, self.device, encode(message), message.message_id,
                            model_version=env.model_version, codec="safetensors", extra={"tensors": {}}))

    def _stage(self, env: Envelope) -> None:
        """A stage request (:mod:`edgefl.stages`): answered by the filter or the client
        half that owns the stage, as an upload of kind ``stage``."""
        if env.message_id in self.handled:
            return
        info = env.extra.get("info") if isinstance(env.extra.get("info"), dict) else {}
        name = info.get("stage")
        if not isinstance(name, str) or not is_safe_name(name):
            raise PayloadError("a stage request names its stage in info.stage")
        if env.codec == "safetensors":
            request = decode(env.body, self.net.max_message_bytes)
            if request.sender != "server":
                raise PayloadError(f"the message inside names sender {printable(request.sender, 64)!r}, not the server")
        else:
            request = Message("stage", env.round, "server", {}, {})
        self.handled.add(env.message_id)
        reply = next((r for r in (f.answer_stage(name, request) for f in self.filters) if r is not None), None)
        if reply is None:
            reply = self.client.answer_stage(name, request)
        if reply is None:
            raise PayloadError(f"stage {printable(name, 64)!r}: neither this device's method nor its filters answer it")
        message = Message("stage", env.round, self.device, reply.tensors, {**reply.meta, "stage": name})
        self._send(Envelope("upload", self.federation, env.round, self.device, encode(message), message.message_id,
                            model_version=env.model_version, codec="safetensors", extra={"tensors": tensor_manifest(message.tensors)}))

    # --- what survives a crash ------------------------------------------------------------------
    def carry_state(self) -> dict[str, torch.Tensor]:
        """The client half's carried state and each filter's (prefixed ``filter.<i>.``)."""
        out = dict(self.client.carry_state())
        for i, f in enumerate(self.filters):
            out.update({f"{FILTER_STATE}{i}.{name}": t for name, t in f.carry_state().items()})
        return out

    def load_carry_state(self, tensors: dict[str, torch.Tensor]) -> None:
        mine = {k: v for k, v in tensors.items() if not k.startswith(FILTER_STATE)}
        self.client.load_carry_state(mine)
        for i, f in enumerate(self.filters):
            prefix = f"{FILTER_STATE}{i}."
            f.load_carry_state({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})

    def _send(self, upload: Envelope, pieces: list[int] | None = None) -> None:
        known = self.pending.get(upload.message_id)
        if known is None:
            chunks = split(upload, self.net.chunk_bytes, self.net.chunk_threshold)
            known = self.pending[upload.message_id] = _Pending(upload, chunks, self.transport.now(), self.net.ack_timeout_s)
        known.sent_at = self.transport.now()
        for i in (range(len(known.pieces)) if pieces is None else pieces):
            self.transport.send(known.pieces[i])

    def _answered(self, reply: Envelope) -> None:
        pending = self.pending.get(reply.reply_to)
        if pending is None:  # a nack of one chunk answers the upload that chunk belongs to (rare: look it up then)
            pending = next((p for p in self.pending.values() if reply.reply_to in p.chunk_ids(self.net.max_message_bytes)), None)
        if pending is None:
            return
        upload = pending.upload
        missing = reply.extra.get("missing") if reply.type == "nack" else None
        if missing:
            self._send(upload, [i for i in missing if isinstance(i, int) and 0 <= i < len(pending.pieces)])
            return
        del self.pending[upload.message_id]
        status = reply.extra.get("status") if reply.type == "ack" else reply.extra.get("reason")
        if reply.type == "nack":
            # marked as the echo of the server's refusal: a console that shows the server's line (a
            # simulation, a fleet of threads) drops this one
            log.warning("%s: round %d upload refused: %s", self.device, upload.round, status, extra={"edgefl_event": "upload-refused"})
        self.results[upload.round] = {"reply": reply.type, "status": status}
        trained_upload = getattr(self.served.get(upload.round), "message_id", None) == upload.message_id
        if self.on_answer is not None and reply.type == "ack" and trained_upload:  # not an evaluation's or a stage's answer
            work = self.last_work if self.last_work is not None and self.last_work.round == upload.round else None
            trained = f", trained on {work.samples} samples" if work is not None and work.samples else ""
            self.on_answer(f"{self.device}: round {upload.round}: upload {printable(status, 64)}{trained}")

    def tick(self) -> None:
        """Resend every upload left unanswered past its wait, doubling the wait (at most 120 s):
        the server or the broker may be busy or restarting. Partial downloads that stopped
        arriving are dropped (the server sends a download again when the device comes back)."""
        for _, upload_id, _, dropped in self.reassembler.collect_stale():
            if dropped:
                log.warning("%s: dropped partial download %s (stopped arriving)", self.device, printable(upload_id, 64))
        now = self.transport.now()
        for pending in list(self.pending.values()):
            if now - pending.sent_at >= pending.wait_s:
                pending.wait_s = min(pending.wait_s * 2, 120.0)
                self._send(pending.upload)

    # --- blocking use (a real device) -------------------------------------------------------------
    def run(self, timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
        """Serve rounds until the server says the run is done (or ``timeout_s`` passes)."""
        started = self.transport.now()
        self._defer_training = True
        try:
            while not self.finished:
                item = self.transport.receive(0.2)
                reading_since = self.transport.now()
                while item is not None:
                    self.handle(item)
                    if self.transport.now() - reading_since >= DRAIN_MAX_S:
                        break  # a stream that never pauses (a flood) must not keep the device from training or resending
                    item = self.transport.receive(0)
                    if item is None and self._waiting is not None:
                        # a burst of queued deliveries (a reconnect) may still be on the wire: a short quiet first
                        item = self.transport.receive(SETTLE_S)
                if not self.finished:  # every delivery at hand is read: the newest download is trained
                    self.train_waiting()
                self.tick()
                if timeout_s is not None and self.transport.now() - started > timeout_s:
                    break
        finally:
            self._defer_training = False
            self._waiting = None
        return self.results
