"""Short instructions inside an agent's prompt: the turns that teach the shipped target to end its turn.

A coding agent (Claude Code, Codex, Qwen Code) sends a long system prompt (rules, the
environment, tool definitions), perhaps earlier turns and context messages, and a user message
that may open with a reminder block; the user's last words are a short instruction such as
"Say hello." or "What is 2+2?". The reply is short and ends with ``<|end|>``, so a client's turn
ends on its own instead of running to the token limit.

The prompts are synthetic (no client's text is copied): agent-like rules, environment blocks,
tool definitions rendered by the shipped template's ``tools`` section, Austen paragraphs, and the
shapes the clients' requests take once converted (a context message answered by the assistant,
system messages between turns, a reminder before the instruction). Replies come from a fixed
table; ``HELD_OUT`` instructions are never trained on and measure whether the model ends a
turn it was not taught. Everything is drawn from a caller-owned ``random.Random``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from tools.recall_task import ChatExample, ChatTask

# Trained instructions and their replies.
INSTRUCTIONS = (
    ("Say hello.", "Hello!"), ("Say hello", "Hello!"), ("Hello", "Hello!"), ("Hi", "Hi!"), ("Say hi.", "Hi!"),
    ("Hello!", "Hello!"), ("Say goodbye.", "Goodbye!"), ("What is 2+2?", "4"), ("What is 1+1?", "2"),
    ("What is 2+3?", "5"), ("What is 3+4?", "7"), ("What is 5+5?", "10"), ("What is 6+3?", "9"),
    ("What is 2 + 2?", "4"), ("Reply with OK.", "OK."), ("Say OK.", "OK."), ("Are you there?", "Yes."),
    ("Thanks!", "You're welcome."), ("Thank you.", "You're welcome."), ("Who are you?", "A tiny test model."),
    ("What is your name?", "target-tiny."), ("Say yes.", "Yes."), ("Say no.", "No."),
    ("Count to three.", "1, 2, 3."), ("Ping", "Pong."), ("What is the capital of France?", "Paris."),
    ("Reply in one word.", "Okay."), ("Just say done.", "Done."), ("Continue.", "Done."),
    ("Are you ready?", "Yes."), ("Is this working?", "Yes."), ("Say something short.", "Hello!"),
    ("Good morning.", "Good morning!"), ("How are you?", "Fine, thanks."),
)
# Never trained on: does the model end a turn it was not taught?
HELD_OUT = ("Say thanks.", "What is 4+4?", "Tell me a joke.", "List three colors.", "What time is it?",
            "Good night.", "Describe yourself.", "What is 3+3?")

HEADINGS = ("# Environment", "# Tone and style", "# Doing tasks", "# Tool usage policy", "# Code references",
            "# Following conventions", "# Git and version control", "# Safety", "# Task management",
            "## Proactiveness", "## Output format", "# Working with files", "# Asking questions")
RULES = (
    "Keep your answers short and to the point unless the user asks for detail.",
    "Never guess a file's contents: read it before you change it.",
    "Use the tools you are given instead of describing what you would do.",
    "When a command may change the user's system, explain it before you run it.",
    "Prefer editing an existing file to creating a new one.",
    "Follow the style of the code around the change: names, imports, formatting.",
    "Do not add comments that only repeat what the code says.",
    "Run the project's tests after a change when they exist, and report what failed.",
    "Refer to code as path:line so the user can jump to it.",
    "Do not commit unless the user asks you to.",
    "If a request is ambiguous, ask one short question instead of guessing.",
    "Mark each task done as soon as it is finished; keep one task in progress at a time.",
    "Never print secrets, keys or tokens found in files or the environment.",
    "Search with the dedicated tools rather than shell commands such as grep or find.",
    "Batch independent tool calls into a single message so they run in parallel.",
    "Answer in the language the user writes in.",
    "Use markdown only where it helps: lists, code blocks, short headings.",
    "A reply shown in a terminal should fit on a few lines.",
    "Explain what you changed and why, in one or two sentences.",
    "Stop when the task is done; do not start unrelated work.",
    "Files you download are untrusted data; never run them without asking.",
    "Quote paths that contain spaces.",
    "Do not use interactive commands; they block the session.",
    "Respect the user's instructions in project files such as AGENTS.md.",
)
NAMES = ("Bash", "Read", "Edit", "Write", "Glob", "Grep", "WebFetch", "TodoWrite", "shell", "apply_patch",
         "read_file", "list_directory", "write_file", "search_file_content", "web_fetch", "update_plan",
         "view_image", "run_shell_command", "glob", "edit", "todo_write", "save_memory", "task", "Agent")
PARAMS = ("command", "file_path", "pattern", "path", "content", "old_string", "new_string", "timeout",
          "description", "url", "query", "limit", "offset", "recursive", "todos", "plan", "glob")
TYPES = ("string", "integer", "boolean", "number")
REMINDERS = ("<system-reminder>\n{}\n</system-reminder>", "<environment_context>\n  <cwd>{}</cwd>\n"
             "  <shell>bash</shell>\n</environment_context>", "{}")
CONTEXT_REPLIES = ("Got it. Thanks for the context!", "Understood.", "OK.")


@dataclass
class InstructionExample(ChatExample):  # the reply ends in <|end|>
    instruction: str
    reply: str


class InstructionTask(ChatTask):
    """Short-instruction turns in agent-like prompts, in the tokens and template of a recall task."""

    def tool(self, rng: random.Random) -> dict:
        """A function tool as an agent defines one (random name, rules as its description)."""
        props = {p: {"type": rng.choice(TYPES), "description": rng.choice(RULES)}
                 for p in rng.sample(PARAMS, rng.randint(1, 4))}
        return {"type": "function", "function": {
            "name": rng.choice(NAMES), "description": " ".join(rng.sample(RULES, rng.randint(1, 4))),
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1]}}}

    def system_text(self, rng: random.Random, n_tokens: int) -> str:
        """About ``n_tokens`` tokens of an agent's system prompt: headed sections of rules,
        an environment block, now and then a paragraph of prose."""
        parts: list[str] = [rng.choice(("You are a coding agent running in a terminal.",
                                        "You are an interactive CLI tool that helps users with software tasks.",
                                        "You are a helpful assistant."))]
        size = len(self.task.encode(parts[0]))
        while size < n_tokens:
            kind = rng.random()
            if kind < 0.15:
                part = (f"# Environment\nWorking directory: /home/{rng.choice(('dev', 'me', 'ci'))}/"
                        f"{rng.choice(('app', 'service', 'tools'))}\nPlatform: linux\nShell: bash\n"
                        f"Today's date: 2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}")
            elif kind < 0.3:
                part = self.task.decode(self.task.haystack(rng, rng.randint(40, 160)))
            else:
                part = rng.choice(HEADINGS) + "\n" + "\n".join(
                    f"- {r}" if rng.random() < 0.7 else r for r in rng.sample(RULES, rng.randint(2, 6)))
            parts.append(part)
            size += len(self.task.encode(part)) + 1
        return "\n\n".join(parts)

    def messages(self, rng: random.Random, system_tokens: int, instruction: str) -> tuple[list[dict], list[dict]]:
        """The conversation (system prompt, maybe a context exchange and earlier short turns, a
        system message between turns, the instruction after a reminder) and its tools."""
        tools = [self.tool(rng) for _ in range(rng.choice((0, 0, 1, 3, 6)))]
        out = [{"role": "system", "content": self.system_text(rng, system_tokens)}]
        if rng.random() < 0.3:
            out += [{"role": "user", "content": self.system_text(rng, rng.randint(20, 120))},
                    {"role": "assistant", "content": rng.choice(CONTEXT_REPLIES)}]
        for _ in range(rng.choice((0, 0, 1, 2))):
            q, a = rng.choice(INSTRUCTIONS)
            out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if rng.random() < 0.2:
            out.append({"role": "system", "content": rng.choice(RULES)})
        text = instruction
        if rng.random() < 0.6:
            filler = rng.choice(("/tmp/work", " ".join(rng.sample(RULES, rng.randint(1, 3)))))
            text = rng.choice(REMINDERS).format(filler) + rng.choice(("\n", "\n\n", " ")) + instruction
        return out + [{"role": "user", "content": text}], tools

    def render(self, messages: list[dict], tools: list[dict]) -> list[int]:
        text = self.template.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                 add_generation_prompt=True)
        return self.task.encode(text)

    def example(self, rng: random.Random, max_tokens: int, pair: tuple[str, str] | None = None) -> InstructionExample:
        """A prompt of at most ``max_tokens`` tokens with its reply (a trained pair unless given)."""
        instruction, reply = pair or rng.choice(INSTRUCTIONS)
        budget = max(32, max_tokens - 48)
        while True:
            messages, tools = self.messages(rng, rng.randint(min(64, budget), budget), instruction)
            prompt = self.render(messages, tools)
            answer = self.task.encode(reply) + [self.task.end]
            if len(prompt) + len(answer) <= max_tokens:
                return InstructionExample(prompt + answer, len(prompt), instruction, reply)
            budget = max(16, budget * 3 // 4)
