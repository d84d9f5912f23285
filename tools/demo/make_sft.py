"""The demo's fine-tuning inputs: a byte-level tokenizer folder with a ChatML template
(token b is byte b, as tools/text2tokens.py's; 256 <|endoftext|>, 257 <|im_start|>,
258 <|im_end|>), and arithmetic chats as JSON lines (train and validation).

    python tools/demo/make_sft.py TOKENIZER_DIR TRAIN.jsonl VAL.jsonl
"""
import json
import random
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte -> character map

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tokenizer(out):
    b2u = bytes_to_unicode()
    tk = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", chat_template=CHATML).save_pretrained(out)


def chats(path, n, rng):
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 49), rng.randint(0, 49)
            msgs = [{"role": "user", "content": f"What is {a} + {b}?"},
                    {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]
            if rng.random() < 0.3:
                msgs = [{"role": "system", "content": "You add numbers."}] + msgs
            f.write(json.dumps({"messages": msgs}) + "\n")


tokenizer(sys.argv[1])
rng = random.Random(0)
chats(sys.argv[2], 3000, rng)
chats(sys.argv[3], 300, rng)
