"""lich: a synchronous agent loop in one file.

lich drives a chat model through a think-act-observe loop: it calls the model, runs
the tools the model asks for, feeds the results back, compresses history when the
context budget demands it, and records every run as a JSONL session that can be
resumed. No asyncio; ``requests`` is its only dependency, imported when first used.

    import lich

    tools = lich.Tools()

    @tools.tool
    def add(a: int, b: int) -> int:
        "Add two numbers."
        return a + b

    chat = lich.chat_from_spec("openai:gpt-4.1-mini")
    run = lich.run_agent("What is 2 + 40?", chat=chat, tools=tools, max_turns=5,
                         session_dir="sessions")
    print(run.final["content"], run.session_path)

``python lich.py "prompt"`` is a command-line agent on the same module.
"""

import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, TypedDict, runtime_checkable

__version__ = "0.1.0"

__all__ = [
    # errors
    "AbortError", "ProviderError", "SessionNotFound",
    # data
    "Message", "ToolCall", "ToolSpec", "Usage",
    "ChatResult", "ToolResult", "LoopOutcome", "ToolRunner",
    # events
    "AgentEmitter",
    # tokens and compression
    "KEEP_RECENT_TURNS", "TRANSCRIPT_MAX_CHARS", "COMPRESSION_SYSTEM_PROMPT",
    "estimate_text_tokens", "estimate_messages_tokens", "should_compress",
    "compress_messages", "compress_if_needed",
    # the loop
    "seed_system_prompt", "call_chat", "run_tool_calls", "run_conversation",
    "format_tool_result_content", "tool_message_from_result",
    # sessions
    "SessionHandle", "AgentRunResult", "open_session", "run_agent",
    "read_session_messages", "resolve_session",
    # tools
    "Tools", "coding_tools", "DEFAULT_MAX_OUTPUT_CHARS",
    # command line
    "main",
]

_log = logging.getLogger("lich")


# ============================================================================
# Errors
# ============================================================================


class AbortError(Exception):
    """The caller's signal was set: the loop, a stream or a backoff stopped early."""


class ProviderError(Exception):
    """A chat provider failed; ``kind`` says how, ``retryable`` whether trying again may help."""

    RETRYABLE_KINDS = frozenset({"rate_limit", "overloaded", "server", "timeout", "network"})

    def __init__(self, message, kind="server", *, status=None, provider="", retryable=None,
                 retry_after=None):
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.status = status
        self.provider = provider
        self.retryable = kind in self.RETRYABLE_KINDS if retryable is None else retryable
        self.retry_after = retry_after

    def __repr__(self):
        return (f"ProviderError({self.message!r}, kind={self.kind!r}, status={self.status!r}, "
                f"provider={self.provider!r}, retryable={self.retryable!r}, "
                f"retry_after={self.retry_after!r})")


class SessionNotFound(LookupError):
    """A session reference matched no session file, or more than one."""


# ============================================================================
# Data
# ============================================================================


class ToolCall(TypedDict):
    """A tool call the model asked for; ``arguments`` is the model's raw JSON text."""

    id: str
    name: str
    arguments: str


class Message(TypedDict, total=False):
    """A provider-neutral chat message, JSON-ready.

    system / user:  {"role": "system" | "user", "content": str}
    assistant:      {"role": "assistant", "content": str, "tool_calls": [ToolCall, ...]}
                    (``content`` is "" when the model said nothing; ``tool_calls`` may be
                    absent or empty)
    tool:           {"role": "tool", "tool_call_id": str, "name": str, "content": str,
                     "is_error": bool}
    """

    role: str
    content: str
    tool_calls: List[ToolCall]
    tool_call_id: str
    name: str
    is_error: bool


class ToolSpec(TypedDict):
    """A tool offered to the model; ``parameters`` is a JSON Schema object."""

    name: str
    description: str
    parameters: Dict[str, Any]


class Usage(TypedDict):
    """Token counts of one chat call (or a run's sum)."""

    input_tokens: int
    output_tokens: int


def _zero_usage():
    return {"input_tokens": 0, "output_tokens": 0}


@dataclass
class ChatResult:
    """What one chat call returned."""

    message: dict
    usage: dict = field(default_factory=_zero_usage)
    model: Optional[str] = None
    stop_reason: Optional[str] = None


@dataclass
class ToolResult:
    """What one tool call returned; a failure is data the model sees, not an exception."""

    ok: bool
    output: str = ""
    error: Optional[str] = None


@dataclass
class LoopOutcome:
    """How ``run_conversation`` ended."""

    messages: list
    final: Optional[dict]
    result: Optional[ChatResult]
    turns_used: int
    stopped_reason: str


@runtime_checkable
class ToolRunner(Protocol):
    """Anything that offers tool specs and runs tool calls, never raising."""

    def specs(self) -> list: ...

    def run(self, call: dict, signal: Optional[threading.Event] = None) -> ToolResult: ...


# ============================================================================
# Events
# ============================================================================


class AgentEmitter:
    """Delivers loop events (plain dicts with a ``"type"``) to subscribed handlers.

    Handlers run synchronously in the emitting thread, in subscription order. ``emit``
    iterates a snapshot, so a handler may unsubscribe itself or others; a handler that
    raises is logged on the ``lich`` logger and the others still run.
    """

    def __init__(self):
        self._handlers = ()  # (type or None, handler) pairs; replaced, never mutated
        self._lock = threading.Lock()

    def on(self, type: str, handler: Callable[[dict], Any]) -> Callable[[], None]:
        """Call ``handler(event)`` for every event of ``type``; returns the unsubscribe function."""
        return self._subscribe(type, handler)

    def on_any(self, handler: Callable[[dict], Any]) -> Callable[[], None]:
        """Call ``handler(event)`` for every event; returns the unsubscribe function."""
        return self._subscribe(None, handler)

    def emit(self, event: dict) -> None:
        """Deliver ``event`` to the handlers subscribed when the call began."""
        event_type = event["type"]
        for wanted, handler in self._handlers:
            if wanted is None or wanted == event_type:
                try:
                    handler(event)
                except Exception:
                    _log.exception("event handler %r failed on %r event", handler, event_type)

    def _subscribe(self, event_type, handler):
        entry = (event_type, handler)
        with self._lock:
            self._handlers = self._handlers + (entry,)

        def unsubscribe():
            with self._lock:
                handlers = list(self._handlers)
                for i, existing in enumerate(handlers):
                    if existing is entry:
                        del handlers[i]
                        self._handlers = tuple(handlers)
                        break

        return unsubscribe


# ============================================================================
# Tokens and compression
# ============================================================================


# ============================================================================
# The loop
# ============================================================================


# ============================================================================
# Sessions
# ============================================================================


# ============================================================================
# Providers
# ============================================================================


# ============================================================================
# Tools
# ============================================================================

DEFAULT_MAX_OUTPUT_CHARS = 50_000
_TOOL_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
_ECHO_MAX_CHARS = 80  # how much of a rejected value an error message quotes
_ARGS_HEADERS = ("args:", "arguments:", "parameters:", "params:", "keyword args:",
                 "keyword arguments:")
_DOC_SECTIONS = _ARGS_HEADERS + ("returns:", "return:", "yields:", "raises:", "example:",
                                 "examples:", "note:", "notes:", "see also:")
_ARG_DOC_RE = re.compile(r"\*{0,2}([A-Za-z_]\w*)\s*(?:\([^)]*\))?\s*:\s*(.*)\Z")


class _ToolFailure(Exception):
    """A refusal of a tool: its message is the ``error`` the model sees."""


class _ArgError(Exception):
    """An argument value that does not fit its parameter's type."""

    def __init__(self, expected, got):
        super().__init__(expected)
        self.expected = expected
        self.got = got
        self.path = []  # "[2]", '["key"]' ... from the argument down to the bad value


def _json_kind(value):
    """The JSON type of a decoded value, as a phrase for error messages."""
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    if value is None:
        return "null"
    return f"a {type(value).__name__}"


def _echo(value):
    """A value as JSON, cut to ``_ECHO_MAX_CHARS``, to quote in an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= _ECHO_MAX_CHARS else text[:_ECHO_MAX_CHARS] + "..."


def _accept_any(value):
    return value


def _to_str(value):
    if isinstance(value, str):
        return value
    raise _ArgError("a string", _json_kind(value))


def _to_int(value):
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _ArgError("an integer", _json_kind(value))


def _to_float(value):
    if isinstance(value, float):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise _ArgError("a number", _json_kind(value))


def _to_bool(value):
    if isinstance(value, bool):
        return value
    raise _ArgError("a boolean", _json_kind(value))


def _list_of(item):
    """A converter for a JSON array whose items go through ``item``."""
    def convert(value):
        if not isinstance(value, list):
            raise _ArgError("an array", _json_kind(value))
        if item is _accept_any:
            return value
        out = []
        for i, each in enumerate(value):
            try:
                out.append(item(each))
            except _ArgError as e:
                e.path.insert(0, f"[{i}]")
                raise
        return out
    return convert


def _dict_of(item):
    """A converter for a JSON object whose values go through ``item``."""
    def convert(value):
        if not isinstance(value, dict):
            raise _ArgError("an object", _json_kind(value))
        if item is _accept_any:
            return value
        out = {}
        for key, each in value.items():
            try:
                out[key] = item(each)
            except _ArgError as e:
                e.path.insert(0, f"[{json.dumps(key, ensure_ascii=False)}]")
                raise
        return out
    return convert


def _one_of(values):
    """A converter accepting exactly the ``Literal`` values (``True`` is not ``1``)."""
    expected = "one of " + ", ".join(json.dumps(v) for v in values)

    def convert(value):
        for allowed in values:
            if value == allowed and type(value) is type(allowed):
                return value
        raise _ArgError(expected, _echo(value))
    return convert


def _nullable(inner):
    """A converter accepting ``null`` or what ``inner`` accepts."""
    def convert(value):
        if value is None:
            return None
        try:
            return inner(value)
        except _ArgError as e:
            if not e.path:
                e.expected += " or null"
            raise
    return convert


def _nullable_schema(schema):
    """``schema`` widened to admit ``null``."""
    if not schema:
        return schema
    out = dict(schema)
    kind = out.get("type")
    if isinstance(kind, str):
        out["type"] = [kind, "null"]
    elif isinstance(kind, list) and "null" not in kind:
        out["type"] = kind + ["null"]
    if "enum" in out and None not in out["enum"]:
        out["enum"] = out["enum"] + [None]
    return out


_SIMPLE_HINTS = {str: ("string", _to_str), int: ("integer", _to_int),
                 float: ("number", _to_float), bool: ("boolean", _to_bool)}
_LITERAL_KINDS = {str: "string", int: "integer", bool: "boolean", type(None): "null"}
_NO_HINT = object()


def _hint_schema(hint):
    """(JSON Schema, converter) for a type hint, or None when JSON Schema cannot express it."""
    import types
    import typing
    if hint is _NO_HINT or hint is Any:
        return {}, _accept_any
    try:
        simple = _SIMPLE_HINTS.get(hint)
    except TypeError:  # an unhashable hint
        simple = None
    if simple is not None:
        return {"type": simple[0]}, simple[1]
    origin = typing.get_origin(hint) or hint
    args = typing.get_args(hint)
    if origin is list:
        item = _hint_schema(args[0]) if args else ({}, _accept_any)
        if item is None:
            return None
        schema = {"type": "array"}
        if item[0]:
            schema["items"] = item[0]
        return schema, _list_of(item[1])
    if origin is dict:
        if args and args[0] is not str:
            return None  # JSON object keys are strings
        value = _hint_schema(args[1]) if args else ({}, _accept_any)
        if value is None:
            return None
        schema = {"type": "object"}
        if value[0]:
            schema["additionalProperties"] = value[0]
        return schema, _dict_of(value[1])
    if origin is typing.Union or origin is getattr(types, "UnionType", None):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            return None  # only Optional[X]: a model cannot tell other unions apart reliably
        inner = _hint_schema(rest[0])
        if inner is None:
            return None
        return _nullable_schema(inner[0]), _nullable(inner[1])
    if origin is typing.Literal:
        kinds = []
        for value in args:
            kind = _LITERAL_KINDS.get(type(value))
            if kind is None:
                return None
            if kind not in kinds:
                kinds.append(kind)
        schema = {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
        return schema, _one_of(args)
    return None


def _admits_null(schema):
    """Whether a schema made by ``_hint_schema`` accepts ``null``."""
    kind = schema.get("type")
    return not schema or kind == "null" or (isinstance(kind, list) and "null" in kind)


def _is_event_hint(hint):
    """Whether ``hint`` is ``threading.Event`` or ``Optional[threading.Event]``."""
    import typing
    if typing.get_origin(hint) is not None:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return len(rest) == 1 and _is_event_hint(rest[0])
    return isinstance(hint, type) and issubclass(hint, threading.Event)


def _parse_docstring(doc):
    """(description, {parameter: description}) from a docstring: its first paragraph and a
    Google-style ``Args:`` section."""
    lines = doc.expandtabs().splitlines() if doc else []
    paragraph = []
    for line in lines:
        stripped = line.strip()
        if not stripped:
            if paragraph:
                break
            continue
        if stripped.lower() in _DOC_SECTIONS:
            break
        paragraph.append(stripped)
    described = {}
    start = next((i for i, line in enumerate(lines) if line.strip().lower() in _ARGS_HEADERS),
                 None)
    if start is not None:
        header_indent = len(lines[start]) - len(lines[start].lstrip())
        entry_indent = None
        current = None
        for line in lines[start + 1:]:
            stripped = line.strip()
            if not stripped:
                continue
            indent = len(line) - len(line.lstrip())
            if indent <= header_indent:
                break  # the next section
            if entry_indent is None:
                entry_indent = indent
            match = _ARG_DOC_RE.match(stripped) if indent <= entry_indent else None
            if match:
                current = described[match.group(1)] = [match.group(2)] if match.group(2) else []
            elif current is not None:
                current.append(stripped)
    return " ".join(paragraph), {name: " ".join(words) for name, words in described.items()}


def _type_hints(fn, fn_name):
    """The resolved type hints of ``fn``; a hint that cannot be resolved is a TypeError."""
    import inspect
    import typing
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        target = fn
    elif inspect.isclass(fn):
        target = fn.__init__
    else:
        target = type(fn).__call__
    try:
        return typing.get_type_hints(target)
    except NameError as e:
        raise TypeError(f"cannot register {fn_name}: a type hint cannot be resolved: {e}") from e
    except TypeError:
        return {}  # not a plain function (a functools.partial...): the signature's hints stand


def _truncate(text, limit):
    """``text`` cut to its head and tail, ``limit`` characters in all, around a marker."""
    if len(text) <= limit:
        return text
    tail = limit // 2
    head = limit - tail
    omitted = len(text) - limit
    return f"{text[:head]}\n[... {omitted} characters omitted ...]\n{text[len(text) - tail:]}"


class _Tool:
    """One registered function, with what ``run`` needs precomputed."""

    __slots__ = ("call_param", "converters", "fn", "name", "required", "signal_param", "spec")

    def __init__(self, name, fn, spec, converters, required, signal_param, call_param):
        self.name = name
        self.fn = fn
        self.spec = spec
        self.converters = converters
        self.required = required
        self.signal_param = signal_param
        self.call_param = call_param

    def arguments(self, raw):
        """The keyword arguments of a call from the model's raw JSON text; _ToolFailure if unfit."""
        if isinstance(raw, str):
            if raw.strip():
                try:
                    args = json.loads(raw)
                except (ValueError, RecursionError) as e:
                    raise _ToolFailure(f"the arguments of {self.name} are not valid JSON ({e}); "
                                       f"send one JSON object") from None
            else:
                args = {}
        elif raw is None:
            args = {}
        else:
            args = raw
        if not isinstance(args, dict):
            raise _ToolFailure(f"the arguments of {self.name} must be a JSON object, "
                               f"not {_json_kind(args)}")
        converters = self.converters
        kwargs = {}
        unknown = []
        problems = []
        for key, value in args.items():
            convert = converters.get(key)
            if convert is None:
                unknown.append(key)
                continue
            try:
                kwargs[key] = convert(value)
            except _ArgError as e:
                problems.append(f"argument '{key}{''.join(e.path)}' must be {e.expected}, "
                                f"not {e.got}")
        missing = [name for name in self.required if name not in args]
        if not (unknown or missing or problems):
            return kwargs
        found = []
        if unknown:
            takes = ", ".join(converters) if converters else "no arguments"
            found.append(f"unknown {_plural('argument', unknown)} ({self.name} takes {takes})")
        if missing:
            found.append(f"missing required {_plural('argument', missing)}")
        raise _ToolFailure(f"invalid arguments for {self.name}: " + "; ".join(found + problems))


def _plural(word, names):
    """``argument 'a'`` or ``arguments 'a', 'b'``."""
    quoted = ", ".join(f"'{name}'" for name in names)
    return f"{word} {quoted}" if len(names) == 1 else f"{word}s {quoted}"


class Tools:
    """A ToolRunner over plain Python functions.

    Register a function with ``@tools.tool`` (or ``tools.tool(name=..., description=...)``, or
    ``tools.register(fn)``): its JSON Schema comes from its type hints -- ``str``, ``int``,
    ``float``, ``bool``, ``list[X]``, ``dict`` / ``Dict[str, X]``, ``Optional[X]``,
    ``Literal[...]``; a parameter without a hint (or ``Any``) accepts any JSON value -- and
    its docstring: the first paragraph describes the tool, a Google-style ``Args:`` section
    the parameters. A parameter with a default is optional. A parameter annotated
    ``threading.Event`` is not offered to the model: it receives the loop's signal (a fresh,
    unset Event when the loop has none). ``run`` never raises: bad calls and exceptions
    become failed ToolResults, and output over ``max_output_chars`` keeps its head and tail.
    """

    def __init__(self, *, max_output_chars=DEFAULT_MAX_OUTPUT_CHARS):
        if isinstance(max_output_chars, bool) or not isinstance(max_output_chars, int):
            raise TypeError(f"max_output_chars must be an int, not {max_output_chars!r}")
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars must be 1 or more, not {max_output_chars}")
        self.max_output_chars = max_output_chars
        self._tools = {}

    def tool(self, fn=None, *, name=None, description=None):
        """Register ``fn`` as a tool; usable as ``@tools.tool`` or ``@tools.tool(name=...)``."""
        if fn is None:
            return lambda f: self.register(f, name=name, description=description)
        return self.register(fn, name=name, description=description)

    def register(self, fn, name=None, description=None):
        """Register ``fn`` as a tool and return it unchanged."""
        self._register(fn, name, description)
        return fn

    def specs(self) -> list:
        """The tool specs, in registration order."""
        return [tool.spec for tool in self._tools.values()]

    def run(self, call: dict,
            signal: Optional[threading.Event] = None) -> ToolResult:  # noqa: FA100
        """Run one tool call; never raises: every failure is a failed ToolResult."""
        try:
            if not isinstance(call, dict):
                return ToolResult(ok=False, error="a tool call must be an object with a name and "
                                                  "arguments")
            tool = self._tools.get(call.get("name")) if isinstance(call.get("name"), str) else None
            if tool is None:
                return ToolResult(ok=False, error=self._limit(self._unknown(call.get("name"))))
            kwargs = tool.arguments(call.get("arguments"))
            if tool.signal_param is not None:
                kwargs[tool.signal_param] = signal if signal is not None else threading.Event()
            if tool.call_param is not None:
                kwargs[tool.call_param] = call
            value = tool.fn(**kwargs)
            if isinstance(value, str):
                return ToolResult(ok=True, output=self._limit(value))
            if value is None:
                return ToolResult(ok=True)
            if isinstance(value, ToolResult):
                return self._passed(value)
            try:
                text = json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError, RecursionError):
                text = repr(value)
            return ToolResult(ok=True, output=self._limit(text))
        except _ToolFailure as e:
            return ToolResult(ok=False, error=self._limit(str(e)))
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- run never raises
            _log.debug("tool call %r raised", call, exc_info=True)
            return ToolResult(ok=False, error=self._limit(f"{type(e).__name__}: {e}"))

    def _register(self, fn, name, description, call_param=None):
        """Register ``fn``; ``call_param`` names a parameter that receives the call itself."""
        import inspect
        if not callable(fn):
            raise TypeError(f"a tool must be callable, not {fn!r}")
        if name is None:
            name = getattr(fn, "__name__", None)
        if not isinstance(name, str) or not _TOOL_NAME_RE.match(name):
            raise ValueError(f"invalid tool name {name!r}: use 1 to 64 letters, digits, '_' or '-'")
        if name in self._tools:
            raise ValueError(f"a tool named {name!r} is already registered")
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError) as e:
            raise TypeError(f"cannot register {name}: {e}") from e
        hints = _type_hints(fn, name)
        doc_description, arg_docs = _parse_docstring(inspect.getdoc(fn))
        properties, converters, required = {}, {}, []
        signal_param = None
        for param in signature.parameters.values():
            if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                raise TypeError(f"cannot register {name}: parameter {param.name!r} is "
                                f"{param.kind.description}; a tool takes keyword arguments")
            if param.name == call_param:
                continue
            hint = hints.get(param.name, param.annotation)
            if hint is param.empty:
                hint = _NO_HINT
            if _is_event_hint(hint):
                signal_param = param.name
                continue
            made = _hint_schema(hint)
            if made is None:
                raise TypeError(f"cannot register {name}: parameter {param.name!r} has the type "
                                f"hint {hint!r}, which JSON Schema cannot express; use str, int, "
                                f"float, bool, list, dict, Optional or Literal")
            schema, convert = made
            if param.default is None and not _admits_null(schema):
                # what Python < 3.11 does to such hints anyway: the same schema on every version
                schema, convert = _nullable_schema(schema), _nullable(convert)
            schema = dict(schema)
            if param.name in arg_docs:
                schema["description"] = arg_docs[param.name]
            if param.default is param.empty:
                required.append(param.name)
            elif _json_ready(param.default):
                schema["default"] = param.default
            properties[param.name] = schema
            converters[param.name] = convert
        parameters = {"type": "object", "properties": properties}
        if required:
            parameters["required"] = required
        parameters["additionalProperties"] = False
        spec = {"name": name,
                "description": doc_description if description is None else description,
                "parameters": parameters}
        self._tools[name] = _Tool(name, fn, spec, converters, tuple(required), signal_param,
                                  call_param)

    def _unknown(self, name):
        shown = _echo(name) if isinstance(name, str) else repr(name)
        if not self._tools:
            return f"unknown tool {shown}; no tools are available"
        return f"unknown tool {shown}; the available tools are: {', '.join(self._tools)}"

    def _limit(self, text):
        return _truncate(text, self.max_output_chars)

    def _passed(self, result):
        """A ToolResult a function returned, its texts cut to ``max_output_chars``."""
        output, error = result.output, result.error
        if (isinstance(output, str) and len(output) > self.max_output_chars) or (
                isinstance(error, str) and len(error) > self.max_output_chars):
            return ToolResult(ok=result.ok,
                              output=self._limit(output) if isinstance(output, str) else output,
                              error=self._limit(error) if isinstance(error, str) else error)
        return result


def _json_ready(value):
    """Whether ``value`` can go into a JSON Schema as a default."""
    try:
        json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


# ---- coding_tools ------------------------------------------------------------

_READ_DEFAULT_LIMIT = 2000      # lines read_file returns unless asked for fewer or more
_LINE_MAX_CHARS = 2000          # read_file and search cut longer lines
_READ_MAX_CHARS = 40_000        # read_file stops here and says where to go on
_BINARY_SNIFF_BYTES = 8192      # a NUL byte in this much of a file makes it binary
_LIST_MAX_FILES = 500           # list_files names at most this many files
_SEARCH_MAX_MATCHES = 200       # search shows at most this many matching lines
_SEARCH_LINE_CHARS = 500        # search cuts the lines it shows to this
_WALK_MAX_ENTRIES = 100_000     # list_files and search stop scanning after this many entries
_EDIT_MAX_BYTES = 10_000_000    # edit_file refuses bigger files
_SHELL_KEEP_BYTES = 20_000      # bash keeps this much of the head and of the tail of its output
_SHELL_READ_BYTES = 65_536      # one read from the shell's pipe
_SHELL_POLL_SECONDS = 0.05      # how often bash looks at the signal and the clock
_SHELL_DRAIN_SECONDS = 0.2      # output still read after the shell exits, before the kill
_SKIP_DIRS = frozenset({".git", "node_modules", "__pycache__", ".venv", "venv"})
_UTF8_MAX_BYTES = 4


def _fs_failure(error, path):
    """An OSError on ``path`` (as the model gave it) as a _ToolFailure the model can act on."""
    import errno
    if isinstance(error, FileNotFoundError):
        return _ToolFailure(f"no such file or directory: {path}")
    if isinstance(error, PermissionError):
        return _ToolFailure(f"permission denied: {path}")
    if isinstance(error, NotADirectoryError):
        return _ToolFailure(f"a part of the path is not a directory: {path}")
    if error.errno == errno.ELOOP:
        return _ToolFailure(f"too many levels of symbolic links: {path}")
    return _ToolFailure(f"{error.strerror or error}: {path}")


def _read_lines(f, max_chars):
    """(text, cut) per line of the binary file ``f``: at most ``max_chars`` characters of the
    line (undecodable bytes replaced) and how many more it had; memory stays bounded."""
    import codecs
    cap = max_chars * _UTF8_MAX_BYTES + 2
    while True:
        raw = f.readline(cap)
        if not raw:
            return
        if raw.endswith(b"\n") or len(raw) < cap:
            text = raw.decode("utf-8", "replace")
            text = text.removesuffix("\n").removesuffix("\r")
            yield text[:max_chars], max(0, len(text) - max_chars)
            continue
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text = decoder.decode(raw)
        more = 0
        while True:
            chunk = f.readline(_SHELL_READ_BYTES)
            ended = chunk.endswith(b"\n") or not chunk
            more += len(decoder.decode(chunk.rstrip(b"\r\n") if ended else chunk, final=ended))
            if ended:
                break
        yield text[:max_chars], len(text) - max_chars + more


def _is_binary(f):
    """Whether the binary file ``f`` holds a NUL byte near its start; rewinds it."""
    head = f.read(_BINARY_SNIFF_BYTES)
    f.seek(0)
    return b"\0" in head


def _glob_regex(pattern):
    """A regular expression for a glob: ``**`` spans folders, ``*`` and ``?`` stay within one
    name, ``[...]`` is a class and ``{a,b}`` an alternative."""
    out = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] in "!^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            j = pattern.find("]", j)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:j].replace("\\", "\\\\")
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = j
        elif c == "{" and pattern.find("}", i) > i:
            j = pattern.find("}", i)
            choices = pattern[i + 1:j].split(",")
            out.append("(?:" + "|".join(_glob_regex(choice) for choice in choices) + ")")
            i = j
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _glob_matcher(pattern):
    """A test ``(path relative to the folder, file name) -> bool`` for a glob; a pattern
    without ``/`` tests the file name, at any depth."""
    while pattern.startswith("./"):
        pattern = pattern[2:]
    regex = re.compile(_glob_regex(pattern), re.DOTALL)
    if "/" in pattern:
        return lambda rel, name: regex.fullmatch(rel) is not None
    return lambda rel, name: regex.fullmatch(name) is not None


def _match_all(rel, name):
    return True


class _HeadTail:
    """A byte sink that keeps the first and the last ``keep`` bytes and counts the rest."""

    def __init__(self, keep):
        self.keep = keep
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def write(self, data):
        self.total += len(data)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.keep:
                del self.tail[:-self.keep]

    def text(self):
        """What was kept, decoded (undecodable bytes replaced), with a marker for the rest."""
        del self.tail[:-self.keep]
        omitted = self.total - len(self.head) - len(self.tail)
        if not omitted:
            return bytes(self.head + self.tail).decode("utf-8", "replace")
        return (self.head.decode("utf-8", "replace") + f"\n[... {omitted} bytes omitted ...]\n"
                + self.tail.decode("utf-8", "replace"))


def _with_newline(text):
    return text + "\n" if text and not text.endswith("\n") else text


def _kill_group(pgid):
    """SIGKILL every process of the group ``pgid``; whether there was any left to kill."""
    import signal as signals
    try:
        os.killpg(pgid, signals.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _run_shell(command, cwd, timeout, signal):
    """Run ``command`` with ``/bin/sh -c``: output streamed and capped, the process group
    killed on timeout, on the signal, and when the shell is done."""
    import selectors
    import subprocess
    if signal.is_set():
        return ToolResult(ok=False, error="the command was aborted before it started")
    proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    sink = _HeadTail(_SHELL_KEEP_BYTES)
    stopped = None
    try:
        deadline = time.monotonic() + timeout
        drain_until = None
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while True:  # read until EOF: every process holding the pipe is gone
                now = time.monotonic()
                if signal.is_set():
                    stopped = "aborted"
                    break
                if now >= deadline:
                    stopped = "timeout"
                    break
                if drain_until is None and proc.poll() is not None:
                    drain_until = now + _SHELL_DRAIN_SECONDS  # a background child holds the pipe
                if drain_until is not None and now >= drain_until:
                    break
                wait = min(_SHELL_POLL_SECONDS, deadline - now)
                if selector.select(wait):
                    chunk = os.read(fd, _SHELL_READ_BYTES)
                    if not chunk:
                        break
                    sink.write(chunk)
        while stopped is None and proc.poll() is None:  # the shell closed its output early
            now = time.monotonic()
            if now >= deadline:
                stopped = "timeout"
            elif signal.wait(min(_SHELL_POLL_SECONDS, deadline - now)):
                stopped = "aborted"
    finally:
        leftovers = _kill_group(proc.pid)
        proc.stdout.close()
        proc.wait()
    text = sink.text()
    if stopped == "timeout":
        return ToolResult(ok=False, output=text, error=f"the command timed out after {timeout:g} "
                                                       f"seconds and was killed")
    if stopped == "aborted":
        return ToolResult(ok=False, output=text, error="the command was aborted and killed")
    if leftovers:
        text = _with_newline(text) + "[background processes left running were killed]\n"
    code = proc.returncode
    text = _with_newline(text) + f"[exit code {code}]"
    if code == 0:
        return ToolResult(ok=True, output=text)
    if code < 0:
        return ToolResult(ok=False, output=text, error=f"the command was killed by signal {-code}")
    return ToolResult(ok=False, output=text, error=f"the command exited with code {code}")


class _Workspace:
    """The coding tools over one root folder; every path is confined to it."""

    def __init__(self, root, approve, shell_timeout):
        real = os.path.realpath(root)
        if not os.path.isdir(real):
            raise ValueError(f"root is not a directory: {root}")
        self.root = real
        self._prefix = real if real.endswith(os.sep) else real + os.sep
        self.approve = approve
        self.shell_timeout = shell_timeout

    def read_file(self, path: str, offset: int = 1, limit: int = _READ_DEFAULT_LIMIT) -> str:
        """Read a text file of the workspace: its lines, numbered from 1; long lines are cut.

        Args:
            path: The file, relative to the workspace root.
            offset: The number of the first line to read.
            limit: The most lines to read.
        """
        if offset < 1 or limit < 1:
            raise _ToolFailure("offset and limit must be 1 or more")
        real = self._resolve(path)
        lines = []
        size = 0
        number = 0
        go_on = None
        with self._open_file(real, path) as f:
            if _is_binary(f):
                raise _ToolFailure(f"path is a binary file, not text: {path}")
            for number, (text, cut) in enumerate(_read_lines(f, _LINE_MAX_CHARS), 1):
                if number < offset:
                    continue
                line = f"{number:6}\t{text}" + (f" [... {cut} more characters]" if cut else "")
                if number >= offset + limit or (lines and size + len(line) > _READ_MAX_CHARS):
                    go_on = number
                    break
                lines.append(line)
                size += len(line) + 1
        if not lines:
            if number == 0:
                return "(the file is empty)"
            raise _ToolFailure(f"offset {offset} is past the end of {path}, which has {number} "
                               f"lines")
        if go_on is not None:
            lines.append(f"[... the file goes on; read more with offset={go_on}]")
        return "\n".join(lines)

    def list_files(self, path: str = ".", pattern: str = "**/*") -> str:
        """List the files under a folder of the workspace, sorted, as paths from the root;
        skips .git, node_modules, __pycache__, .venv and venv.

        Args:
            path: The folder, relative to the workspace root.
            pattern: A glob the file paths, relative to that folder, must match, such as
                "**/*.py" or "src/*.{js,ts}"; one without "/" matches file names at any depth.
        """
        real = self._resolve(path)
        self._require_dir(real, path)
        found, complete = self._walk(real, _glob_matcher(pattern))
        found.sort()
        lines = found[:_LIST_MAX_FILES]
        if len(found) > _LIST_MAX_FILES:
            lines.append(f"... {len(found) - _LIST_MAX_FILES} more")
        if not complete:
            lines.append(_scan_note())
        return "\n".join(lines) if lines else f"no files match {pattern} under {path}"

    def search(self, pattern: str, path: str = ".",
               glob: Optional[str] = None,  # noqa: FA100
               *, signal: threading.Event) -> str:
        """Search the text files of the workspace, line by line, for a regular expression;
        answers with "file:line: text" lines.

        Args:
            pattern: A Python regular expression (the re module's syntax).
            path: The folder or file to search, relative to the workspace root.
            glob: Only search the files matching this glob, such as "*.py" or "src/**/*.ts".
        """
        import stat
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise _ToolFailure(f"invalid regular expression: {e}") from None
        real = self._resolve(path)
        mode = self._stat(real, path).st_mode
        if stat.S_ISDIR(mode):
            files, complete = self._walk(real, _glob_matcher(glob) if glob else _match_all)
            files.sort()
        elif stat.S_ISREG(mode):
            files, complete = [self._relative(real)], True
        else:
            raise _ToolFailure(f"path is not a regular file or a directory: {path}")
        lines = []
        matches = 0
        for shown in files:
            if signal.is_set():
                raise _ToolFailure("the search was aborted")
            try:
                with self._open_file(os.path.join(self.root, shown), shown) as f:
                    if _is_binary(f):
                        continue
                    for number, (text, _) in enumerate(_read_lines(f, _LINE_MAX_CHARS), 1):
                        if regex.search(text):
                            matches += 1
                            if matches <= _SEARCH_MAX_MATCHES:
                                lines.append(f"{shown}:{number}: {text[:_SEARCH_LINE_CHARS]}")
            except (OSError, _ToolFailure):
                continue  # vanished or unreadable meanwhile
        if matches > _SEARCH_MAX_MATCHES:
            lines.append(f"... {matches - _SEARCH_MAX_MATCHES} more matches")
        if not complete:
            lines.append(_scan_note())
        return "\n".join(lines) if lines else "no matches"

    def write_file(self, path: str, content: str, call: dict) -> str:
        """Create or overwrite a text file of the workspace; missing folders are created.

        Args:
            path: The file, relative to the workspace root.
            content: The whole new text of the file.
        """
        import stat
        real = self._resolve(path)
        try:
            mode = os.stat(real).st_mode
        except FileNotFoundError:
            mode = None
        except OSError as e:
            raise _fs_failure(e, path) from None
        if mode is not None and stat.S_ISDIR(mode):
            raise _ToolFailure(f"path is a directory: {path}")
        if mode is not None and not stat.S_ISREG(mode):
            raise _ToolFailure(f"path is not a regular file: {path}")
        try:
            data = content.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _ToolFailure(f"content cannot be written as UTF-8: {e}") from None
        self._approve(call)
        try:
            os.makedirs(os.path.dirname(real), exist_ok=True)
            with open(real, "wb") as f:
                f.write(data)
        except OSError as e:
            raise _fs_failure(e, path) from None
        return f"wrote {len(content)} characters to {path}"

    def edit_file(self, path: str, old_text: str, new_text: str, call: dict) -> str:
        """Replace old_text, which must occur exactly once in the file, with new_text.

        Args:
            path: The file, relative to the workspace root.
            old_text: The text to replace, copied exactly (whitespace included), with enough
                of its surroundings to occur only once.
            new_text: The text to put in its place.
        """
        if not old_text:
            raise _ToolFailure("old_text is empty; copy the exact text to replace from the file")
        real = self._resolve(path)
        self._edited(real, path, old_text, new_text)
        self._approve(call)
        data = self._edited(real, path, old_text, new_text)  # the file may have changed meanwhile
        try:
            with open(real, "wb") as f:
                f.write(data)
        except OSError as e:
            raise _fs_failure(e, path) from None
        return f"replaced 1 occurrence of old_text in {path}"

    def bash(self, command: str, call: dict, signal: threading.Event) -> ToolResult:
        """Run a shell command.

        Args:
            command: The command, run by /bin/sh -c.
        """
        if not command.strip():
            raise _ToolFailure("command is empty")
        self._approve(call)
        return _run_shell(command, self.root, self.shell_timeout, signal)

    def _resolve(self, path):
        """The real path of ``path`` (relative to the root), which must lie inside the root."""
        if "\0" in path:
            raise _ToolFailure(f"path contains a NUL character: {path!r}")
        real = os.path.realpath(os.path.join(self.root, path))
        if not self._inside(real):
            raise _ToolFailure(f"path is outside the workspace: {path}")
        return real

    def _inside(self, real):
        return real == self.root or real.startswith(self._prefix)

    def _relative(self, real):
        return "." if real == self.root else real[len(self._prefix):]

    def _stat(self, real, path):
        try:
            return os.stat(real)
        except OSError as e:
            raise _fs_failure(e, path) from None

    def _require_dir(self, real, path):
        import stat
        if not stat.S_ISDIR(self._stat(real, path).st_mode):
            raise _ToolFailure(f"path is not a directory: {path}")

    def _open_file(self, real, path):
        """``real`` opened for binary reading, refused unless a regular file; never blocks."""
        import stat
        mode = self._stat(real, path).st_mode
        if stat.S_ISDIR(mode):
            raise _ToolFailure(f"path is a directory, not a file: {path}; list_files shows "
                               f"what it holds")
        if not stat.S_ISREG(mode):
            raise _ToolFailure(f"path is not a regular file: {path}")
        try:
            fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as e:
            raise _fs_failure(e, path) from None
        f = os.fdopen(fd, "rb")
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since the stat
            f.close()
            raise _ToolFailure(f"path is not a regular file: {path}")
        return f

    def _walk(self, top, matches):
        """(paths from the root of the files under the real folder ``top`` that ``matches``,
        whether the scan was complete); symbolic links to folders are not followed."""
        base = self._relative(top)
        prefix = "" if base == "." else base + "/"
        found = []
        seen = 0
        pending = [""]
        while pending:
            folder = pending.pop()
            try:
                with os.scandir(os.path.join(top, folder)) as it:
                    entries = list(it)
            except OSError:
                continue
            for entry in entries:
                seen += 1
                if seen > _WALK_MAX_ENTRIES:
                    return found, False
                rel = folder + entry.name
                try:
                    if entry.is_symlink():
                        target = os.path.realpath(entry.path)
                        if not (self._inside(target) and os.path.isfile(target)):
                            continue
                    elif entry.is_dir(follow_symlinks=False):
                        if entry.name not in _SKIP_DIRS:
                            pending.append(rel + "/")
                        continue
                    elif not entry.is_file(follow_symlinks=False):
                        continue
                except OSError:
                    continue
                if matches(rel, entry.name):
                    found.append(prefix + rel)
        return found, True

    def _edited(self, real, path, old_text, new_text):
        """The bytes of the file with its one ``old_text`` replaced; _ToolFailure otherwise."""
        with self._open_file(real, path) as f:
            data = f.read(_EDIT_MAX_BYTES + 1)
        if len(data) > _EDIT_MAX_BYTES:
            raise _ToolFailure(f"{path} is too large to edit (over {_EDIT_MAX_BYTES} bytes); "
                               f"use write_file or bash")
        if b"\0" in data[:_BINARY_SNIFF_BYTES]:
            raise _ToolFailure(f"path is a binary file, not text: {path}")
        text = data.decode("utf-8", "surrogateescape")
        count = text.count(old_text)
        if count == 0:
            raise _ToolFailure(f"old_text was not found in {path}; read the file and copy the "
                               f"text exactly, whitespace included")
        if count > 1:
            raise _ToolFailure(f"old_text occurs {count} times in {path}; include more of the "
                               f"surrounding text so that it occurs exactly once")
        try:
            return text.replace(old_text, new_text, 1).encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as e:
            raise _ToolFailure(f"new_text cannot be written as UTF-8: {e}") from None

    def _approve(self, call):
        if self.approve is not None and not self.approve(call):
            raise _ToolFailure("the user declined this call")


def _scan_note():
    return f"[... stopped after scanning {_WALK_MAX_ENTRIES} entries; narrow the path or pattern]"


def coding_tools(root=".", *, allow_write=False, allow_shell=False, approve=None,
                 shell_timeout=120) -> Tools:
    """The built-in tools of the command line, confined to the folder ``root``.

    ``read_file``, ``list_files`` and ``search`` always; ``write_file`` and ``edit_file`` with
    ``allow_write``; ``bash`` with ``allow_shell``. Every path is resolved, symbolic links
    included, and must lie inside ``root``. ``approve(call) -> bool``, when given, is asked
    before each write or shell call whose arguments are valid; ``False`` declines it.
    ``bash`` runs ``/bin/sh -c`` in ``root`` in a process group of its own, which is killed
    after ``shell_timeout`` seconds, when the signal is set, and when the shell exits
    (background processes do not outlive the call).
    """
    if approve is not None and not callable(approve):
        raise TypeError(f"approve must be callable or None, not {approve!r}")
    if isinstance(shell_timeout, bool) or not isinstance(shell_timeout, (int, float)):
        raise TypeError(f"shell_timeout must be a number, not {shell_timeout!r}")
    if not shell_timeout > 0:
        raise ValueError(f"shell_timeout must be above 0, not {shell_timeout}")
    workspace = _Workspace(root, approve, shell_timeout)
    tools = Tools()
    tools.register(workspace.read_file)
    tools.register(workspace.list_files)
    tools.register(workspace.search)
    if allow_write:
        tools._register(workspace.write_file, None, None, call_param="call")
        tools._register(workspace.edit_file, None, None, call_param="call")
    if allow_shell:
        tools._register(
            workspace.bash, None,
            f"Run a shell command with /bin/sh in the workspace root; answers with its output "
            f"(stdout and stderr together) and its exit code. Stdin is closed; the command is "
            f"killed after {shell_timeout:g} seconds; background processes do not outlive it.",
            call_param="call")
    return tools


# ============================================================================
# Command line
# ============================================================================


def main(argv=None) -> int:
    """Run the lich command line; returns the process exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args == ["--version"]:
        print(f"lich {__version__}")
        return 0
    print("lich: the command line is not built yet; try --version", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
