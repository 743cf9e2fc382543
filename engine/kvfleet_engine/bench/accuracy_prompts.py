"""The fixed chat prompts of `kvfleet bench accuracy`'s greedy agreement."""

from __future__ import annotations

from typing import Any

# Fixed chat prompts: everyday questions, instructions and short tasks.
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is.",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
    "What does a compiler do?",
    "Summarise the plot of Romeo and Juliet.",
    "What is photosynthesis?",
    "How do I boil an egg?",
    "Name three planets in the solar system.",
    "What is the difference between a virus and a bacterium?",
    "Write a short poem about autumn leaves.",
    "How does a refrigerator keep food cold?",
    "What is a prime number?",
    "Translate 'good morning' into Spanish.",
    "Give me a recipe for a simple salad.",
    "What causes rain?",
    "Explain gravity to a child.",
    "What are the primary colours?",
    "How many days are there in a leap year?",
    "What is the largest ocean on Earth?",
    "Describe a cat in two sentences.",
    "What is an API?",
    "Why do we have seasons?",
    "List four common fruits.",
    "What does a doctor do?",
    "Explain what recursion means in programming.",
    "How do bees make honey?",
    "What is the boiling point of water?",
    "Write a sentence using the word 'serendipity'.",
    "What is the role of the heart in the human body?",
    "Give me two reasons to learn a second language.",
    "What is a noun?",
    "How does the internet work, briefly?",
    "What is the tallest mountain in the world?",
    "Suggest a name for a pet goldfish.",
    "What is democracy?",
    "Why should we drink water every day?",
    "What is the speed of light?",
    "How do plants grow from seeds?",
    "Write a friendly greeting for a birthday card.",
    "What is a sorting algorithm?",
    "Explain what a museum is.",
    "What do pandas eat?",
    "How can I save money each month?",
    "What is the moon made of?",
    "Describe the colour blue to someone.",
    "What is a volcano?",
    "Give me a fun fact about octopuses.",
    "What is the purpose of a library?",
)


def chat_prompts(tokenizer: Any, num: int) -> list[list[int]]:
    """The first `num` fixed questions, each as a user message in the chat template."""
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
        )
        for question in PROMPTS[:num]
    ]
