"""Prompts of mixed length and script (English, Chinese, code, chat) for the exactness tests."""

LONG_DOC = ("Continuous batching lets a serving engine admit new requests at every step instead of "
            "waiting for a whole batch to finish. Paged attention stores keys and values in fixed-size "
            "blocks, so memory is allocated on demand and shared between sequences. ") * 6

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the ocean.",
    "def fibonacci(n):",
    "你好，请介绍一下你自己。",
    "List three primary colors:",
    "import numpy as np\n\ndef softmax(x):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Translate to French: The weather is nice today.",
    LONG_DOC + "\nSummarize the text above in one sentence:",
    "Q: What is 17 times 23?\nA:",
    "北京是中国的首都，它有很多名胜古迹，比如",
    "SELECT name, COUNT(*) FROM users GROUP BY",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "In machine learning, overfitting means",
    "Emoji story: 🐶🏠🌧️ ->",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "Hello",
]
