"""The three PPC-GPT prompts (paper, App. B, Tables 8 and 9) for multiple-choice tasks.

PPC-GPT's server turns each perturbed client question into synthetic training data with three
prompts to a generator model (``LLM_syn``):

1. **question generation** (:attr:`PromptSet.question`): a new, self-contained question with its
   choices, "similar but new", written from a (perturbed) client question and its choices;
2. **answer generation** (:attr:`PromptSet.answer`): a step-by-step solution ending in
   ``FINAL ANSWER: <letter>``; it is sampled several times (3 in the paper) and the question is
   kept only when every sample gives the same choice;
3. **rationale generation** (:attr:`PromptSet.rationale`): a short explanation of why the agreed
   answer is right (one worked example, then the new question; the reply ends with ``<end>``).

The texts below are the paper's, word for word, except where a placeholder had to become
concrete: the answer prompt lists the choices with letters, ``(A) ... (B) ...`` (its final answer
must be "just a letter", so the letters have to be in the prompt), and the rationale prompt's
``{choices.text[choices.label.index(answerKey)]}`` is the answer's text (``{answer}``).

Template fields (``str.format`` placeholders; a literal brace would be written ``{{``/``}}``):

============  =====================================================================  ==========
field         value                                                                   used by
============  =====================================================================  ==========
question      the question text, stripped                                             all three
choices       :func:`list_choices` (``['x', 'y']``) for ``question``/``rationale``;   all three
              :func:`letter_choices` (``(A) x (B) y``) for ``answer``
answer        the text of the right choice, quoted as in the paper's example          rationale
============  =====================================================================  ==========

A prompt is a list of chat messages (``[{"role": "user", "content": ...}]``, the OpenAI
format). :func:`render_prompt` turns it into the text a local model continues: through the
tokenizer's chat template when it has one (instruct models), else as plain text.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ANSWER_PROMPT",
    "LETTERS",
    "PPC_GPT_PROMPTS",
    "Message",
    "Prompt",
    "PromptSet",
    "QUESTION_PROMPT",
    "RATIONALE_PROMPT",
    "answer_prompt",
    "as_messages",
    "has_chat_template",
    "letter_choices",
    "list_choices",
    "question_prompt",
    "rationale_prompt",
    "render_prompt",
]

logger = logging.getLogger(__name__)

#: Letters naming the choices, in order (a question may have at most 26 choices).
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

#: One chat message, ``{"role": "system" | "user" | "assistant", "content": str}``.
Message = Mapping[str, str]
#: What a backend receives: chat messages, or a plain string (one user message).
Prompt = str | Sequence[Message]

#: Paper, Table 8, "Question Generation". Fields: ``question``, ``choices`` (list format).
QUESTION_PROMPT = """\
Please act as a professional teacher.
Your goal is to promote research in advanced question-answering, probing a deeper understanding \
of both the topic (with salient facts summarized as an open book, also provided with the \
dataset) and the language it is expressed in.
You will be given a multiple-choice question. Please create a new question and multiple choices \
based on the Given Question And Multiple Choices and following instructions.
To achieve the goal, you have two jobs.
# Please generate a similar but new question and multiple choices according to the Given \
Question And Multiple Choices.
# Check the question and multiple choices by solving it step-by-step to find out if it adheres \
to all principles.
You have eight principles to do this.
# Ensure the new question only asks for one thing, be reasonable, be based on the Given \
Question And Multiple Choices, and can be answered with only one right choice.
# Ensure the new questions requires multi-step reasoning, use of additional common and \
commonsense knowledge.
# Ensure the new question is in line with common sense of life.
# Ensure your student can answer the new question without the given question. If you want to \
use some numbers, conditions or background in the given question, please restate them to ensure \
no information is omitted in your new question.
# Please DO NOT include solution in your question.
# Make sure the choices in CREATED QUESTION AND CHOICES are list format, starts with [and ends \
with].
# Ensure only one choice in CREATED QUESTION AND CHOICES is right.
# Ensure your output only has three lines, the first line is "CREATED QUESTION AND CHOICES:", \
the second line starts with "Question:", and the third line starts with "Choices".
Given Question and Multiple Choices: {question}, {choices}
Your output should be in the following format:
CREATED QUESTION AND CHOICES:
Question: <your created question>
Choices: <your created choices>"""

#: Paper, Table 8, "Answer Generation". Fields: ``question``, ``choices`` (lettered).
ANSWER_PROMPT = """\
Please act as a professional teacher.
Your goal is to accurately solve a multiple-choice question.
To achieve the goal, you have two jobs.
# Write detailed solution to a Given Question.
# Write the final choice to this question.
You have three principles to do this.
# Ensure the solution is step-by-step.
# Ensure the final answer is just a letter.
# Use of additional common and commonsense knowledge.
Given Question and Choices: {question}, {choices}
Your output should be in the following format:
SOLUTION: <your detailed solution to the given question>
FINAL ANSWER: <your final choice to the question with only an uppercase letter>"""

#: Paper, Table 9, "Rationale Generation". Fields: ``question``, ``choices`` (list format),
#: ``answer`` (the right choice's text, quoted).
RATIONALE_PROMPT = """\
You are given the right Answer from Choices, please explain it in "Rationale" with few words. \
Please refer to the example to write the rationale.
Try to generate logically clear and correct rationale. Reply in english only and use '<end>' to \
finish your rationale. Your reply format must strictly follow the provided example and reply \
rationale contents only!
Example(s):
Question: The sun is responsible for
Choices: ['puppies learning new tricks', 'children growing up and getting old', 'flowers \
wilting in a vase', 'plants sprouting, blooming and wilting']
Answer: 'plants sprouting, blooming and wilting'.
Rationale: The sun provides light and warmth, essential for the process of photosynthesis in \
plants, which enables them to grow, bloom, and eventually wilt due to natural life cycles.
Please explain:
Question: {question}
Choices: {choices}
Answer: {answer}.
Rationale:"""


@dataclass(frozen=True)
class PromptSet:
    """The three templates of the pipeline (see the module docstring for their fields).

    The paper customises the formatting standards per dataset; pass another ``PromptSet`` to
    :class:`fedcompress.synth.generate.SynthConfig` to do the same. ``system`` (optional) is
    sent as a system message before each prompt.
    """

    question: str = QUESTION_PROMPT
    answer: str = ANSWER_PROMPT
    rationale: str = RATIONALE_PROMPT
    system: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"question": self.question, "answer": self.answer, "rationale": self.rationale,
                "system": self.system}


#: The paper's prompts (App. B).
PPC_GPT_PROMPTS = PromptSet()


def list_choices(choices: Sequence[str]) -> str:
    """Choices in the paper's list format: ``['first', 'second']`` (Python ``repr`` quoting)."""
    return "[" + ", ".join(repr(str(c).strip()) for c in choices) + "]"


def letter_choices(choices: Sequence[str]) -> str:
    """Choices with letters, on one line: ``(A) first (B) second``.

    Raises:
        ValueError: more than 26 choices.
    """
    if len(choices) > len(LETTERS):
        raise ValueError(f"at most {len(LETTERS)} choices can be lettered, got {len(choices)}")
    return " ".join(f"({LETTERS[i]}) {str(c).strip()}" for i, c in enumerate(choices))


def _messages(content: str, system: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": content}]


def question_prompt(question: str, choices: Sequence[str],
                    prompts: PromptSet = PPC_GPT_PROMPTS) -> list[dict[str, str]]:
    """Chat messages asking for a new question and choices from a (perturbed) example."""
    text = prompts.question.format(question=question.strip(), choices=list_choices(choices))
    return _messages(text, prompts.system)


def answer_prompt(question: str, choices: Sequence[str],
                  prompts: PromptSet = PPC_GPT_PROMPTS) -> list[dict[str, str]]:
    """Chat messages asking for a step-by-step solution ending in ``FINAL ANSWER: <letter>``."""
    text = prompts.answer.format(question=question.strip(), choices=letter_choices(choices))
    return _messages(text, prompts.system)


def rationale_prompt(question: str, choices: Sequence[str], label: int,
                     prompts: PromptSet = PPC_GPT_PROMPTS) -> list[dict[str, str]]:
    """Chat messages asking for the rationale of the right choice ``choices[label]``."""
    text = prompts.rationale.format(question=question.strip(), choices=list_choices(choices),
                                    answer=repr(str(choices[label]).strip()))
    return _messages(text, prompts.system)


def as_messages(prompt: Prompt) -> list[dict[str, str]]:
    """A prompt as chat messages (a string becomes one user message)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template (instruct models do, base models often not)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(prompt: Prompt, tokenizer: Any = None, chat_template: bool | None = None) -> str:
    """The text a model continues for ``prompt``.

    Args:
        prompt: Chat messages or a plain string.
        tokenizer: A ``transformers`` tokenizer; its chat template is used when it has one.
        chat_template: ``True``: use the chat template (error if there is none); ``False``: plain
            text; ``None`` (default): the template when the tokenizer has one.

    Plain text is the messages' contents separated by blank lines, followed by a newline (a
    string prompt is returned as it is); the chat template ends with the assistant's turn
    opened (``add_generation_prompt=True``).

    Raises:
        ValueError: ``chat_template=True`` and the tokenizer has no chat template.
    """
    use_template = has_chat_template(tokenizer) if chat_template is None else chat_template
    if use_template:
        if not has_chat_template(tokenizer):
            raise ValueError("chat_template=True but the tokenizer has no chat template")
        return tokenizer.apply_chat_template(as_messages(prompt), tokenize=False,
                                             add_generation_prompt=True)
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(m["content"] for m in as_messages(prompt)) + "\n"
