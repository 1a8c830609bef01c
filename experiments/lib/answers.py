"""The model's own answers to a seeded prompt set: the training text of `experiments.distill_draft` and the corpus of
`experiments.build_ngram_corpus`.

Open requests (`TASKS` x `TOPICS` first, then the wide pool with `MORE_TASKS` and `MORE_TOPICS`: 2860 distinct
requests) and copy-style requests (`COPY_INSTRUCTIONS`) over the model's earlier answers. Neither the speculative
benchmark's texts nor its chat prompts (`experiments.lib.common`) are among them. No flags here, so that scripts with
flags of their own can import it.
"""

from __future__ import annotations

import time

TOPICS = ["the ocean", "a small town", "python programming", "the history of Rome", "cooking pasta", "climate",
          "a robot", "friendship", "mathematics", "the moon", "gardening", "music theory", "a detective story",
          "machine learning", "coffee", "mountains", "a letter to a friend", "the internet", "birds", "chess",
          "volcanoes", "trains", "the human heart", "honey bees", "deserts", "bicycles", "electricity", "dinosaurs",
          "a lighthouse keeper", "sorting algorithms", "the stock market", "winter sports", "ancient Egypt",
          "recycling", "the solar system", "a job interview", "bread baking", "rivers", "video games", "sleep"]
TASKS = ["Write a short story about {}.", "Explain {} to a child.", "Give three facts about {}.",
         "Write a poem about {}.", "Summarise what you know about {}.", "Write a dialogue about {}.",
         "Write Python code that prints a list of words about {}.", "What are the pros and cons of {}?",
         "Describe {} in a few sentences.", "Give me some tips about {}.", "Why do people care about {}?",
         "Write a Python function related to {} and explain it."]
# More topics and tasks: the wide pool, drawn from only after every TASKS x TOPICS request (so a run of up to 480 open
# prompts asks exactly what it asked before these existed). None is a benchmark prompt (experiments.lib.common.CHAT).
MORE_TOPICS = ["glaciers", "a city park", "the printing press", "bees and flowers", "a rainy day", "space travel",
               "the brain", "pirates", "a school play", "photography", "the Great Wall of China", "earthquakes",
               "a farmer's market", "knitting", "jazz", "penguins", "a treasure map", "solar panels", "the Olympics",
               "a haunted house", "origami", "whales", "public libraries", "a bakery", "spiders", "the Renaissance",
               "wind turbines", "camping", "a magic trick", "the immune system", "skyscrapers", "tigers", "poetry",
               "a time machine", "the water cycle", "airports", "chocolate", "a marathon", "vaccines", "castles",
               "the Amazon rainforest", "board games", "a lost dog", "typewriters", "the periodic table", "kites",
               "a birthday party", "submarines", "the Vikings", "meditation", "tornadoes", "a museum visit",
               "linked lists", "hash tables", "recursion", "unit testing", "a web server", "databases", "encryption",
               "a spreadsheet", "the speed of light", "gravity", "magnets", "a forest fire", "coral reefs", "owls",
               "a train station", "the French Revolution", "democracy", "a street market", "elephants", "painting",
               "a snowstorm", "the first airplane", "robots in factories", "a night sky", "fossils", "volunteering",
               "a small business", "saving money", "running shoes", "the post office", "a farm", "wolves",
               "a science fair", "the printing of money", "a dragon", "an old map", "a bridge", "traffic lights",
               "a hospital", "a football match", "the seasons", "a spaceship crew", "clouds", "a cat", "ants",
               "the telephone", "a library book", "a picnic", "a storm at sea", "lemonade", "a garden pond"]
MORE_TASKS = ["Write a limerick about {}.", "List five questions a student might ask about {}.",
              "Write a news headline and a short article about {}.", "Compare {} with something similar.",
              "Write a short speech about {}.", "Explain {} in one paragraph.",
              "Write a JavaScript function related to {}.", "Tell a joke about {}."]
# Copy-style requests over the target's own earlier answers (the benchmark's copy workload uses other wording
# and other texts: experiments.lib.common.COPY_TASKS / TEXTS)
COPY_INSTRUCTIONS = ["Copy the text below word for word:\n\n{}", "Please repeat this back exactly as written:\n\n{}",
                     "Correct any spelling mistakes in this text:\n\n{}",
                     "Here is a passage. Quote it, then say what it means:\n\n{}",
                     "Rewrite this text, keeping it as close to the original as possible:\n\n{}"]


def open_prompts(n: int, seed: int) -> list[str]:
    """`n` distinct open requests, seeded order: first TASKS x TOPICS, then the rest of the wide pool
    ((TASKS + MORE_TASKS) x (TOPICS + MORE_TOPICS)); repeats only past the wide pool's size."""
    import random

    rng = random.Random(seed)
    pool = [t.format(topic) for t in TASKS for topic in TOPICS]
    rng.shuffle(pool)
    seen = set(pool)
    more = [t.format(topic) for t in TASKS + MORE_TASKS for topic in TOPICS + MORE_TOPICS]
    more = [q for q in dict.fromkeys(more) if q not in seen]
    rng.shuffle(more)
    pool += more
    return [pool[i % len(pool)] for i in range(n)]


def copy_prompts(texts: list[str], n: int, seed: int, max_words: int = 60) -> list[tuple[str, int]]:
    """`n` copy requests, each over one of `texts` (cut to its first `max_words` words), with the index of that
    text in `texts` (empty texts are skipped)."""
    import random

    rng = random.Random(seed + 1)
    usable = [i for i, t in enumerate(texts) if t.strip()]
    out = []
    for i in range(n if usable else 0):
        src = usable[i % len(usable)]
        text = " ".join(texts[src].split(" ")[:max_words])
        out.append((rng.choice(COPY_INSTRUCTIONS).format(text.strip()), src))
    return out


def generate_answers(target, prompts: list[str], max_new: int, temperature: float, seed: int,
                     deadline: float, desc: str, batch: int = 32, top_k: int = 0) -> list[tuple]:
    """The target's answers to `prompts` (chat template) as (prompt ids, answer ids incl. the stop token), in
    order, until `deadline`: continuous batching of up to `batch` jobs (a finished answer's slot takes the next
    prompt at once), `deadline` checked between chunks of 8 x `batch` prompts. Job i's seed is `seed * 100003 + i`.

    `top_k` > 0 adds a third item per answer, the target's distribution at each answer token: its `top_k` most
    likely tokens and their probabilities (i32 / f32 `[len(answer), top_k]`, the generator's `return_top_tokens`,
    free of the sampling settings). The stop token, which the generator holds back without them, gets a one-hot
    row (its id, then -1 ids at probability 0)."""
    import numpy as np
    from tqdm import tqdm

    from experiments.lib.common import chat_prompt
    from paged import DynamicGenerator, Job, SamplingSettings

    tok = target.tokenizer
    seq = min(512, target.config.max_position_embeddings)
    gen = DynamicGenerator(target, max_batch_size=batch, max_seq_len=seq)
    settings = SamplingSettings.greedy() if temperature <= 0 else SamplingSettings(temperature=temperature, top_p=0.95)
    stops = sorted({t for t in (tok.eos_token_id, *(target.config.eos_token_ids or ())) if t is not None})
    out: list[tuple[list[int], list[int]]] = []
    chunk = 8 * batch
    bar = tqdm(total=len(prompts), desc=desc, unit="answer")
    for i in range(0, len(prompts), chunk):
        if time.perf_counter() > deadline:
            bar.write(f"{desc}: generation budget reached after {len(out)} answers")
            break
        ids = [tok.encode(chat_prompt(tok, p), encode_special_tokens=True)[-(seq - max_new - 1):]
               for p in prompts[i : i + chunk]]
        jobs = [Job(x, max_new, gen_settings=settings, stop_conditions=stops, seed=seed * 100003 + i + j,
                    identifier=j, return_top_tokens=top_k) for j, x in enumerate(ids)]
        got: dict[int, list[int]] = {j: [] for j in range(len(jobs))}
        dists: dict[int, list[tuple[list[int], list[float]]]] = {j: [] for j in range(len(jobs))}
        gen.enqueue(jobs)
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r.get("stage") != "streaming":
                    continue
                got[r["identifier"]] += r.get("token_ids", [])
                if top_k:
                    dists[r["identifier"]] += zip(r.get("top_k_tokens", []), r.get("top_k_probs", []))
                if r.get("eos"):
                    held = (r.get("held") or {}).get("token_ids", [])
                    got[r["identifier"]] += held
                    if top_k:
                        dists[r["identifier"]] += [([t] + [-1] * (top_k - 1), [1.0] + [0.0] * (top_k - 1))
                                                   for t in held]
                    bar.update(1)
        if top_k:
            out += [(ids[j], got[j], (np.asarray([d for d, _ in dists[j]], np.int32).reshape(-1, top_k),
                                      np.asarray([p for _, p in dists[j]], np.float32).reshape(-1, top_k)))
                    for j in range(len(jobs))]
        else:
            out += [(ids[j], got[j]) for j in range(len(jobs))]
    bar.close()
    return out


def answer_prompt_set(model, num_prompts: int, max_new: int, temperature: float, seed: int, open_deadline: float,
                      deadline: float, batch: int = 32, top_k: int = 0, desc: str = "generating answers"
                      ) -> tuple[list[tuple], list[int]]:
    """The model's answers (`generate_answers` items) to the seeded prompt set: `num_prompts` // 2 open requests
    (asked until `open_deadline`), then copy requests over those answers for the rest (until `deadline`; job seeds
    from `seed` and `seed + 1`). Also each answer's group: the index of the open answer it is, or copies (so that a
    held-out split keeps a text and its copies together); there are as many groups as open answers."""
    n_open = max(1, num_prompts // 2)
    pairs = generate_answers(model, open_prompts(n_open, seed), max_new, temperature, seed, open_deadline,
                             f"{desc} (open)", batch, top_k=top_k)
    groups = list(range(len(pairs)))
    texts = [model.tokenizer.decode(item[1], decode_special_tokens=False) for item in pairs]
    copies = copy_prompts(texts, num_prompts - n_open, seed)
    got = generate_answers(model, [c for c, _ in copies], max_new, temperature, seed + 1, deadline,
                           f"{desc} (copy)", batch, top_k=top_k)
    return pairs + got, groups + [src for _, src in copies[: len(got)]]
