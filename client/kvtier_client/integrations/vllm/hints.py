"""kvtier's actions in vLLM's KV hints: what an orchestrator may say about a request's
prefix, parsed here and applied by the connector's scheduler side (scheduler.py).

vLLM 0.32 carries an envelope on each request (`Request.kv_hints`, set by
`LLMEngine.add_request(..., kv_hints=KvHintsEnvelope(...))`): {protocol_version, message_id,
actions: [{action_id, action_type, action_version, payload}]}, and defines no action types.
kvtier's, all of action_version "1" (`prefix_tokens`: only the pages wholly within the
prompt's first that many tokens, e.g. a shared system prompt; default the whole prompt):

    kvtier.pin       {"mode": "soft" | "hard" (soft), "ttl_s": seconds (0), "prefix_tokens": n}
    kvtier.retain    {"priority": "cold" | "normal" | "high", "ttl_s": seconds (0), "prefix_tokens": n}
    kvtier.prefetch  {"hold_s": seconds (0: the daemon's prefetch_hold)}
    kvtier.demote    {"tier": "host" | "disk" (disk), "prefix_tokens": n}
    kvtier.drop      {"prefix_tokens": n}

The same envelope as JSON (or its list of actions alone) is also read from the request's
`kv_transfer_params["kvtier_hints"]`, for APIs that pass only those. A prefetch acts when
the request arrives; the others once the request has finished and its saves have settled,
on its pages then in kvtier, in the envelope's order. ttl_s 0 lasts while the engine's
connector does (its session). They mean what kvtier_client.steering says.

Hints never fail a request: other components' action types are skipped, an unknown kvtier
type or version is ignored, a bad payload is ignored; each is counted, and logged once per
kind. What the daemon refuses (a hard pin past the namespace's guarantee) is logged and
counted too.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier_client.errors import KVTierError, Unavailable
from kvtier_client.integrations.vllm.link import DaemonLink, log
from kvtier_client.keys import BlockKey
from kvtier_client.steering import MAX_PREFETCH_HOLD, MAX_TTL_SECONDS, PinMode, Priority
from kvtier_client.tiers import Tier

PREFIX = "kvtier."
ACTION_VERSION = "1"
#: Where kv_transfer_params carry the envelope.
TRANSFER_PARAMS_KEY = "kvtier_hints"


@dataclass(frozen=True)
class Pin:
    mode: PinMode = PinMode.SOFT
    ttl_s: float = 0.0
    prefix_tokens: int | None = None


@dataclass(frozen=True)
class Retain:
    priority: Priority
    ttl_s: float = 0.0
    prefix_tokens: int | None = None


@dataclass(frozen=True)
class Prefetch:
    hold_s: float = 0.0


@dataclass(frozen=True)
class Demote:
    tier: Tier = Tier.DISK
    prefix_tokens: int | None = None


@dataclass(frozen=True)
class Drop:
    prefix_tokens: int | None = None


Action = Pin | Retain | Prefetch | Demote | Drop


@dataclass(frozen=True)
class RequestHints:
    """One request's kvtier actions, in order, and what was left out of them."""

    actions: tuple[Action, ...] = ()
    ignored: int = 0  # unknown kvtier action types or versions (other components' are not counted)
    invalid: int = 0  # bad payloads, malformed envelopes or actions

    @property
    def prefetch(self) -> Prefetch | None:
        return next((a for a in self.actions if isinstance(a, Prefetch)), None)

    @property
    def after(self) -> tuple[Action, ...]:
        """The actions applied once the request's saves have settled."""
        return tuple(a for a in self.actions if not isinstance(a, Prefetch))

    def describe(self) -> dict[str, Any]:
        """For the request's kv_transfer_params: what was taken, ignored and invalid."""
        return {"actions": [PREFIX + type(a).__name__.lower() for a in self.actions], "ignored": self.ignored,
                "invalid": self.invalid}


class BadHint(ValueError):
    """A kvtier action whose payload (or whose envelope) does not parse."""


def _seconds(payload: Mapping[str, Any], name: str, limit: float) -> float:
    value = payload.get(name, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= limit:
        raise BadHint(f"{name} must be seconds from 0 to {limit:.0f}, got {value!r}")
    return float(value)


def _prefix(payload: Mapping[str, Any]) -> int | None:
    value = payload.get("prefix_tokens")
    if value is not None and (type(value) is not int or value < 1):
        raise BadHint(f"prefix_tokens must be a positive integer, got {value!r}")
    return value


def _choice(payload: Mapping[str, Any], name: str, parse: Callable[[str], Any], default: Any = None) -> Any:
    value = payload.get(name, default)
    if value is None:
        raise BadHint(f"{name} is required")
    if not isinstance(value, str):
        raise BadHint(f"{name} must be a string, got {value!r}")
    try:
        return parse(value)
    except ValueError as exc:
        raise BadHint(str(exc)) from None


def _demote_tier(text: str) -> Tier:
    tier = Tier.parse(text)
    if tier not in (Tier.HOST, Tier.DISK):
        raise ValueError(f"demote to {text!r} is not available; use host or disk")
    return tier


def _pin_mode(text: str) -> PinMode:
    try:
        return PinMode(text.lower())
    except ValueError:
        raise ValueError(f"unknown pin mode {text!r}; use soft or hard") from None


#: Each action type: its payload's fields and how to build it.
_PARSERS: dict[str, tuple[frozenset[str], Callable[[Mapping[str, Any]], Action]]] = {
    "pin": (frozenset({"mode", "ttl_s", "prefix_tokens"}), lambda p: Pin(
        _choice(p, "mode", _pin_mode, "soft"), _seconds(p, "ttl_s", MAX_TTL_SECONDS), _prefix(p))),
    "retain": (frozenset({"priority", "ttl_s", "prefix_tokens"}), lambda p: Retain(
        _choice(p, "priority", Priority.parse), _seconds(p, "ttl_s", MAX_TTL_SECONDS), _prefix(p))),
    "prefetch": (frozenset({"hold_s"}), lambda p: Prefetch(_seconds(p, "hold_s", MAX_PREFETCH_HOLD))),
    "demote": (frozenset({"tier", "prefix_tokens"}), lambda p: Demote(_choice(p, "tier", _demote_tier, "disk"),
                                                                     _prefix(p))),
    "drop": (frozenset({"prefix_tokens"}), lambda p: Drop(_prefix(p))),
}


def _field(action: Any, name: str, default: Any = None) -> Any:
    """An action's field, from vLLM's KvHintAction or from its JSON form."""
    if isinstance(action, Mapping):
        return action.get(name, default)
    return getattr(action, name, default)


class HintParser:
    """Reads requests' envelopes; logs each kind of problem once per engine."""

    def __init__(self) -> None:
        self._logged: set[tuple[str, str]] = set()

    def warn_once(self, kind: str, detail: str, message: str) -> None:
        if (kind, detail) not in self._logged:
            self._logged.add((kind, detail))
            log.warning("kvtier connector: %s (logged once per kind)", message)

    def parse(self, kv_hints: Any, transfer_params: Mapping[str, Any] | None) -> RequestHints:
        """A request's actions: those of `kv_hints` (vLLM's envelope), then those under
        kv_transfer_params["kvtier_hints"]. Never raises."""
        actions: list[Action] = []
        ignored = invalid = 0
        sources = [("kv_hints", kv_hints)]
        if isinstance(transfer_params, Mapping) and transfer_params.get(TRANSFER_PARAMS_KEY) is not None:
            sources.append((f"kv_transfer_params[{TRANSFER_PARAMS_KEY!r}]", transfer_params[TRANSFER_PARAMS_KEY]))
        for where, envelope in sources:
            if envelope is None:
                continue
            listed = envelope if isinstance(envelope, list) else _field(envelope, "actions")
            if not isinstance(listed, list):
                invalid += 1
                self.warn_once("envelope", where, f"{where} is not a KV hints envelope (no list of actions); ignored")
                continue
            for action in listed:
                got = self._action(action, where)
                if isinstance(got, str):
                    ignored += got == "ignored"
                    invalid += got == "invalid"
                elif got is not None:
                    actions.append(got)
        return RequestHints(tuple(actions), ignored, invalid)

    def _action(self, action: Any, where: str) -> Action | str | None:
        """The action, None for another component's, or "ignored" / "invalid"."""
        kind = _field(action, "action_type")
        if not isinstance(kind, str):
            self.warn_once("action", where, f"an action in {where} has no action_type: {action!r:.200}; ignored")
            return "invalid"
        if not kind.startswith(PREFIX):
            return None  # another component's action: not ours to judge
        name = kind[len(PREFIX):]
        if name not in _PARSERS:
            self.warn_once("type", kind, f"unknown kvtier hint action {kind!r} (known: "
                           f"{', '.join(PREFIX + n for n in _PARSERS)}); ignored")
            return "ignored"
        version = _field(action, "action_version", ACTION_VERSION)
        if version != ACTION_VERSION:
            self.warn_once("version", f"{kind} {version}", f"{kind} action_version {version!r} is not supported "
                           f"(this connector reads {ACTION_VERSION!r}); ignored")
            return "ignored"
        payload = _field(action, "payload", {})
        fields, build = _PARSERS[name]
        try:
            if not isinstance(payload, Mapping):
                raise BadHint(f"the payload must be an object, got {payload!r:.100}")
            extra = sorted(set(payload) - fields)
            if extra:
                raise BadHint(f"unknown payload fields {extra} (known: {sorted(fields)})")
            return build(payload)
        except (BadHint, TypeError) as exc:
            self.warn_once("payload", kind, f"bad {kind} payload in {where} ({exc}); ignored")
            return "invalid"


@dataclass
class _Pending:
    """A finished or live request's actions still to apply, and its keys per group."""

    hints: RequestHints
    group_keys: list[list[BlockKey]]
    finished: bool = False


@dataclass
class Hinter:
    """The scheduler's hints: parsed at arrival, applied at arrival (prefetch) and once a
    finished request's saves have settled (the rest). `count(**counters)` adds to the
    connector's stats; `page_tokens` is the tokens of one kvtier page."""

    links: list[DaemonLink]
    page_tokens: int
    count: Callable[..., None]
    parser: HintParser = field(default_factory=HintParser)
    _pending: dict[str, _Pending] = field(default_factory=dict)

    def arrived(self, req_id: str, kv_hints: Any, transfer_params: Any, group_keys: list[list[BlockKey]]) -> Prefetch | None:
        """Parse a new request's hints; returns its prefetch action, which the scheduler
        applies with its own prefetch (`prefetch`)."""
        hints = self.parser.parse(kv_hints, transfer_params)
        self.count(hint_actions_ignored=hints.ignored, hint_actions_invalid=hints.invalid)
        if hints.actions or hints.ignored or hints.invalid:  # (kept for the request's report)
            self._pending[req_id] = _Pending(hints, group_keys)
        return hints.prefetch

    def describe(self, req_id: str) -> dict[str, Any] | None:
        pending = self._pending.get(req_id)
        return pending.hints.describe() if pending else None

    def prefetch(self, action: Prefetch, group_keys: list[list[BlockKey]]) -> None:
        self._apply("kvtier.prefetch", lambda link, keys: link.kv.prefetch(keys, hold=action.hold_s), group_keys)

    def finished(self, req_id: str, saving: bool) -> None:
        """The request finished; `saving`: some of its saves have not settled yet."""
        pending = self._pending.get(req_id)
        if pending is None:
            return
        pending.finished = True
        if not saving:
            self.settled(req_id)

    def settled(self, req_id: str) -> None:
        """The finished request's last save settled: apply its actions."""
        pending = self._pending.get(req_id)
        if pending is None or not pending.finished:
            return
        del self._pending[req_id]
        for action in pending.hints.after:
            keys = [g[: action.prefix_tokens // self.page_tokens] if action.prefix_tokens else g
                    for g in pending.group_keys]
            self._apply(PREFIX + type(action).__name__.lower(), _call(action), keys)

    def _apply(self, what: str, call: Callable[[DaemonLink, list[BlockKey]], object],
               group_keys: list[list[BlockKey]]) -> None:
        for link, keys in zip(self.links, group_keys):
            if not keys or not link.available():
                continue
            try:
                call(link, keys)
            except Unavailable as exc:
                self.count(hint_actions_failed=1)
                link.failed(what, exc)
                return
            except KVTierError as exc:  # e.g. a hard pin past the namespace's guaranteed host pages
                self.count(hint_actions_failed=1)
                self.parser.warn_once("refused", f"{what} {type(exc).__name__}", f"{what} of {len(keys)} pages "
                                      f"refused by the daemon: {exc}")
                return
        self.count(hint_actions_applied=1)



def _call(action: Action) -> Callable[[DaemonLink, list[BlockKey]], object]:
    """The client call that applies a settled request's action to one group's keys."""
    if isinstance(action, Pin):
        return lambda link, keys: link.kv.pin(keys, mode=action.mode, ttl=action.ttl_s)
    if isinstance(action, Retain):
        return lambda link, keys: link.kv.retain(keys, action.priority, ttl=action.ttl_s)
    if isinstance(action, Demote):
        return lambda link, keys: link.kv.demote(keys, tier=action.tier)
    if isinstance(action, Drop):
        return lambda link, keys: link.kv.drop(keys)
    raise AssertionError(f"{action!r} is applied at arrival")
