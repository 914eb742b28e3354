"""Chat data for SFT: a `messages` column (lists of {"role", "content"}), rendered with the
tokenizer's chat template, the loss on assistant turns only.

The template is the `chat_template` of `tokenizer_config.json` beside the tokenizer (or a
`chat_template.jinja` file there); without one, mesh3d's default ChatML template
(`DEFAULT_TEMPLATE`: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message) is used when
the tokenizer has the `<|im_start|>` and `<|im_end|>` tokens, and the run is otherwise refused
with one line. Rendering is transformers' `apply_chat_template` (text, not tokens).

Which tokens train (`mesh3d.sft_assistant_turns`): `all` (the default) every assistant turn,
`last` the last one. An assistant turn k trains the characters from the end of the rendering
of messages[:k] with the generation prompt (`add_generation_prompt=True`) to the end of the
rendering of messages[:k + 1]: its content and the template's end-of-turn text. The rendered
conversation is tokenized once, without the tokenizer's own special tokens (the template writes
them), and a token trains when its first character lies in a trained span (`tokenizers`'
offsets). No EOS is appended: the template ends the turns.
"""

from __future__ import annotations

from pathlib import Path

from mesh3d.errors import UserError

DEFAULT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TURNS = ("all", "last")


def chat_template(tokenizer_path: str, where: str, instead: str | None = None) -> str:
    """The chat template of the tokenizer at `tokenizer_path` (see the module docstring).
    Without one the refusal says `where` (what holds the chats; default: an SFT dataset's
    'messages' column) and `instead` (what to do; default: 'prompt' and 'completion' columns)."""
    import json

    from mesh3d.data.tokenizer import load_tokenizer

    p = Path(tokenizer_path)
    folder = p if p.is_dir() else p.parent
    config = folder / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template:
            return template
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    tok = load_tokenizer(tokenizer_path)
    if tok.token_to_id("<|im_start|>") is not None and tok.token_to_id("<|im_end|>") is not None:
        return DEFAULT_TEMPLATE
    if instead is None:
        where = f"{where}: the dataset has a 'messages' column (chat data)"
        instead = (
            "add a chat template beside the tokenizer, or give 'prompt' and 'completion' "
            "columns instead"
        )
    raise UserError(
        f"{where} but this tokenizer ({tokenizer_path}) has no chat template (no chat_template "
        "in tokenizer_config.json, no chat_template.jinja) and no <|im_start|>/<|im_end|> "
        f"tokens for mesh3d's default ChatML template; {instead}"
    )


def _renderer(tokenizer_path: str, template: str):
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise UserError(
            "chat data ('messages') needs the `transformers` package to render its chat "
            "template: pip install transformers"
        ) from None
    p = Path(tokenizer_path)
    file = p / "tokenizer.json" if p.is_dir() else p
    tok = PreTrainedTokenizerFast(tokenizer_file=str(file))
    tok.chat_template = template

    def render(messages: list[dict], generation_prompt: bool) -> str:
        return tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    return render


def trained_spans(messages: list[dict], render, turns: str) -> tuple[str, list[tuple[int, int]]]:
    """(rendered conversation, character spans that train) of one conversation."""
    text = render(messages, False)
    spans = []
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        start = len(render(messages[:k], True))
        end = len(render(messages[: k + 1], False))
        if text[:end] != render(messages[: k + 1], False) or start > end:
            raise UserError(
                "the chat template does not render a conversation as the renderings of its "
                "prefixes followed by the rest; mesh3d cannot find the assistant turns: use "
                "'prompt' and 'completion' columns instead"
            )
        spans.append((start, end))
    if turns == "last":
        spans = spans[-1:]
    return text, spans


def encode_conversation(tokenizer, messages, render, turns: str, seq_len: int):
    """(ids truncated to S + 1, per-id trained flags) of one conversation."""
    text, spans = trained_spans(messages, render, turns)
    enc = tokenizer.encode(text, add_special_tokens=False)
    trained = [any(a <= start < b for a, b in spans) for start, _ in enc.offsets]
    return enc.ids[: seq_len + 1], trained[: seq_len + 1]


def check_messages(value, where: str, row: int) -> list[dict]:
    """A conversation of the dataset (row `row`, from 0), checked: a non-empty list of
    {'role', 'content'}; one line naming the row otherwise."""
    ok = (
        isinstance(value, list)
        and len(value) > 0
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    )
    if not ok:
        raise UserError(
            f"{where}: row {row + 1} of the 'messages' column is "
            f"{'an empty list' if value == [] else 'not a list of {role: str, content: str}'}; "
            "fix that row (a conversation is a non-empty list of {'role': str, 'content': str})"
        )
    return value


def conversation_renderer(tokenizer_path: str, where: str, instead: str | None = None):
    """`render(messages, generation_prompt)` with the tokenizer's chat template (`where`,
    `instead`: the refusal's words, as `chat_template`'s)."""
    return _renderer(tokenizer_path, chat_template(tokenizer_path, where, instead))


def chat_examples(
    column, tokenizer, tokenizer_path: str, seq_len: int, where: str, turns: str, seen
):
    """(encoded conversations, has-a-target test, padding id) of the 'messages' `column`, read
    lazily; `seen[0]` counts the conversations with an assistant turn. A row the template
    refuses is one line naming it."""
    from mesh3d.data.tokenize import find_eos

    render = conversation_renderer(tokenizer_path, where)

    def encode(i: int, messages):
        messages = check_messages(messages, where, i)
        seen[0] += any(m["role"] == "assistant" for m in messages)
        try:
            return encode_conversation(tokenizer, messages, render, turns, seq_len)
        except UserError:
            raise
        except Exception as e:  # the template's own refusals (jinja raise_exception, ValueError)
            raise UserError(
                f"{where}: row {i + 1} of the 'messages' column: the chat template refuses it "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); fix that row"
            ) from None

    encoded = (encode(i, m) for i, m in enumerate(column))
    return encoded, lambda ids, trained: any(trained[1:]), find_eos(tokenizer) or 0
