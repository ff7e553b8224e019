"""The built-in calibration text of `tritonllm quantize`: a few thousand tokens of mixed prose,
instructions, dialogue, code and numbers, written for this project (no dataset is downloaded).
AWQ reads the activation scale of each input channel from it, GPTQ the Hessian of each layer."""

CALIBRATION_TEXT = """\
The old lighthouse stood at the edge of the cliff for more than two hundred years. Every evening the keeper climbed \
the one hundred and twelve steps, wound the clockwork that turned the lens, and lit the lamp. Ships passing in the \
night saw its beam sweep across the water every ten seconds, and they knew where the rocks were. When the keeper \
grew old, his granddaughter learned the work: how to trim the wick, how to clean the salt from the glass, how to \
write the weather in the log before dawn. Years later an electric lamp replaced the flame, and a small computer \
replaced the clockwork, but she still walked up the stairs each night, because someone should look at the sea.

Photosynthesis is the process by which plants, algae and some bacteria turn light into chemical energy. In the \
chloroplasts, pigments such as chlorophyll absorb mostly red and blue light. The energy splits water molecules, \
releasing oxygen, and drives the synthesis of ATP and NADPH. In the Calvin cycle, the enzyme RuBisCO fixes carbon \
dioxide from the air into three-carbon sugars, which the plant uses to build glucose, starch and cellulose. Almost \
all life on Earth depends on this reaction, directly or indirectly, and the oxygen in the atmosphere is its by-product.

User: Can you explain what a hash table is?
Assistant: A hash table stores key-value pairs in an array. A hash function turns each key into an index, so looking \
up a value takes constant time on average. When two keys land on the same index, the table resolves the collision, \
for example by keeping a short list at that slot or by probing the next free slot. Python's dict is a hash table.
User: Why does it get slower when it is full?
Assistant: Collisions become frequent, so each lookup has to check more entries. Most implementations grow the array \
and re-insert every key once the load factor passes a threshold, such as two thirds.

def merge_sorted(left, right):
    \"\"\"Merge two sorted lists into one sorted list.\"\"\"
    result, i, j = [], 0, 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, word: str) -> None:
        self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda item: -item[1])[:n]

Recipe for a simple tomato soup (serves four):
1. Chop one onion and two cloves of garlic, and soften them in olive oil over medium heat for five minutes.
2. Add 800 grams of chopped tomatoes, 500 millilitres of vegetable stock and a pinch of sugar.
3. Simmer for twenty minutes, then blend until smooth.
4. Season with salt, pepper and a few basil leaves. Serve with toasted bread.

The quarterly report showed revenue of 4.2 million dollars, up 12 percent from the same period last year, while \
operating costs rose by only 3 percent. The company attributes the growth to its new subscription plan, which now \
has 18,500 customers in 23 countries. Cash reserves stand at 9.7 million, enough for about three years at the \
current rate of spending. The board expects to hire 40 engineers in the next twelve months.

In 1905, Albert Einstein published four papers that changed physics: on the photoelectric effect, on Brownian \
motion, on special relativity, and on the equivalence of mass and energy. The photoelectric paper proposed that \
light comes in discrete packets, later called photons, and it earned him the Nobel Prize in 1921. Special \
relativity showed that the speed of light is the same for every observer, so that time and space themselves \
must stretch and shrink with motion.

Dear Ms. Alvarez,
Thank you for your letter of March 3rd. I am pleased to confirm that the library will host the exhibition of \
historical maps from the 10th to the 28th of May. The reading room on the second floor will be available for \
the opening evening, and our staff can help with the installation on the 9th. Please let me know how many \
display cases you will need, and whether any of the maps require special lighting.
With kind regards,
Thomas Berg, Head Librarian

SELECT customer_id, COUNT(*) AS orders, SUM(total) AS spent
FROM orders
WHERE created_at >= '2024-01-01'
GROUP BY customer_id
HAVING COUNT(*) > 5
ORDER BY spent DESC
LIMIT 10;

The mountain trail begins at the parking lot beside the river and climbs through a forest of pine and birch. \
After about an hour the trees thin out, and the path follows a ridge with views of three lakes below. Hikers \
should carry water, a map and a warm layer, since the weather changes quickly above the tree line. In winter \
the trail is closed, and the hut at the summit opens only from June to September.

Question: A train leaves at 9:40 and arrives at 13:15. How long is the journey?
Answer: From 9:40 to 12:40 is three hours, and from 12:40 to 13:15 is another 35 minutes, so the journey takes \
3 hours and 35 minutes.
Question: If a shirt costs 25 euros after a 20 percent discount, what was the original price?
Answer: The discounted price is 80 percent of the original, so the original price is 25 / 0.8 = 31.25 euros.

Machine learning models learn patterns from data instead of following rules written by hand. A neural network \
is made of layers of simple units; each unit computes a weighted sum of its inputs and passes it through a \
non-linear function. Training adjusts the weights to reduce a loss, using gradients computed by backpropagation. \
Large language models are trained to predict the next token of text, and at a large enough scale this simple \
objective teaches them grammar, facts and some reasoning. Quantization stores their weights in fewer bits, so \
that they take less memory and run faster, at the cost of a small loss of accuracy.
"""
