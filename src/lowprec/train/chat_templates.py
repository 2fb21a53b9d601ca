"""Chat templates (``type: chat_template``): a conversation -> text segments, each trained or not.

A template is Jinja, as in Hugging Face tokenizers (``tokenizer_default`` is the tokenizer's own
``chat_template``; ``chatml`` and ``llama3`` are written here; ``jinja`` is the config's
``chat_template_jinja``). Which tokens belong to which turn is found by rendering the conversation
one message longer at a time: turn i is ``render(messages[:i+1])`` minus ``render(messages[:i])``.
In a turn, the message's content (found from the end) and the end-of-turn marker right after
it are the trained part when the role is in ``roles_to_train``; the header before it
(``<|im_start|>assistant\\n``) never is, so the model learns answers, not the template.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence
from lowprec.errors import did_you_mean

__all__ = ["TEMPLATES", "TEMPLATE_NAMES", "template_text", "render_segments", "check_template", "EOT_MARKERS"]

# Our own spelling of the two public formats (ChatML; Llama 3 instruct headers).
TEMPLATES = {
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
        " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
}
TEMPLATE_NAMES = (
    "tokenizer_default",
    "chatml",
    "llama3",
    "jinja",
    "tokenizer_default_fallback_chatml",
    "tokenizer_default_fallback_llama3",
)
# end-of-turn strings trained with the turn they close (Axolotl's train_on_eos: turn)
EOT_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "</s>", "<|endoftext|>", "<|end_of_text|>")


def template_text(name: str, tokenizer_template: Optional[str], jinja: Optional[str]) -> str:
    """The Jinja source for ``chat_template: name`` (errors name the fix)."""
    if name == "jinja":
        if not jinja:
            raise ValueError("chat_template: jinja needs chat_template_jinja (the template text); add it")
        return jinja
    if name.startswith("tokenizer_default"):
        if tokenizer_template:
            return tokenizer_template
        fallback = name.removeprefix("tokenizer_default_fallback_")
        if fallback in TEMPLATES:
            return TEMPLATES[fallback]
        raise ValueError(
            "chat_template: tokenizer_default, but the tokenizer has no chat_template (the byte tokenizer "
            "never has one); set chat_template: chatml or llama3, or tokenizer_default_fallback_chatml"
        )
    if name in TEMPLATES:
        return TEMPLATES[name]

    raise ValueError(
        f"chat_template: {name!r} is not one lowprec ships{did_you_mean(name, TEMPLATE_NAMES)}; use one of "
        f"{', '.join(TEMPLATE_NAMES)} (jinja: give the template text in chat_template_jinja)"
    )


def _environment():
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError(
            "type: chat_template needs the 'jinja2' package; install it with `pip install jinja2`"
        ) from None

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env


_FIX = "fix chat_template_jinja (or the tokenizer's chat_template), or use chat_template: chatml"


def _template_error(exc: Exception) -> ValueError:
    """One line for a Jinja error: syntax (with its line), a sandbox refusal, an undefined name."""
    from jinja2.exceptions import SecurityError, TemplateSyntaxError

    what = " ".join(str(exc).split())
    if isinstance(exc, TemplateSyntaxError):
        return ValueError(f"chat template: not valid Jinja (line {exc.lineno}: {what}); {_FIX}")
    if isinstance(exc, SecurityError):  # the sandbox refused an attribute: never run, report
        return ValueError(f"chat template: refused by the sandbox ({what}); templates may only format messages; {_FIX}")
    return ValueError(f"chat template: rendering failed ({type(exc).__name__}: {what}); {_FIX}")


def check_template(template: str) -> None:
    """Compile ``template`` (a syntax error is a config error before any data is read); a
    template that needs more than the sandbox allows is refused when it renders."""
    from jinja2.exceptions import TemplateError

    try:
        _environment().from_string(template)
    except TemplateError as exc:
        raise _template_error(exc) from None


def render_segments(
    template: str,
    messages: Sequence[dict[str, Any]],
    roles_to_train: Sequence[str],
    train_on_eos: str = "turn",
    bos_token: str = "",
    eos_token: str = "",
    eot_tokens: Sequence[str] = (),
) -> list[tuple[str, bool]]:
    """``[(text, trained), ...]`` whose texts join to the rendered conversation."""
    from jinja2.exceptions import TemplateError

    try:
        compiled = _environment().from_string(template)
    except TemplateError as exc:
        raise _template_error(exc) from None
    markers = tuple(dict.fromkeys([*eot_tokens, *EOT_MARKERS, *([eos_token] if eos_token else [])]))

    def render(msgs: Sequence[dict[str, Any]]) -> str:
        try:
            return compiled.render(
                messages=list(msgs), add_generation_prompt=False, bos_token=bos_token, eos_token=eos_token
            )
        except TemplateError as exc:
            raise _template_error(exc) from None

    segments: list[tuple[str, bool]] = []
    done = ""
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        full = render(messages[: i + 1])
        if not full.startswith(done):
            raise ValueError(
                "chat template: rendering one more message changed the text before it (the template "
                "rewrites earlier turns), so turns cannot be masked; use chat_template: chatml or llama3"
            )
        turn = full[len(done) :]
        done = full
        trained = msg["role"] in roles_to_train
        content = str(msg.get("content") or "")
        at = turn.rfind(content) if content else -1
        if at < 0 and content.strip():
            at = turn.rfind(content.strip())
            content = content.strip()
        if at < 0:  # no content to locate: the whole turn follows the role's decision
            segments.append((turn, trained))
            continue
        head, body, tail = turn[:at], content, turn[at + len(content) :]
        eot = _eot_prefix(tail, markers)
        eos_trained = {"turn": trained, "all": True, "none": False, "last": trained and i == last}[train_on_eos]
        segments += [(head, False), (body, trained), (eot, eos_trained), (tail[len(eot) :], False)]
    return [(t, tr) for t, tr in segments if t]


def _eot_prefix(tail: str, markers: Sequence[str]) -> str:
    """The start of ``tail`` up to and including its first end-of-turn marker ('' if none)."""
    found = [(tail.find(m), m) for m in markers if m and tail.find(m) >= 0]
    if not found:
        return ""
    pos, m = min(found)
    return tail[: pos + len(m)] if not tail[:pos].strip() else ""
