"""usage: extend.py CONFIG -- prompt cache: sample prompt A, then A+extension (cache hit on A), greedy vs HF; then a prompt that diverges inside the window"""
import sys; sys.path.insert(0,'/tmp/hunt_long')
from common import *
from configs import CONFIGS
from transformers import AutoModelForCausalLM
name = sys.argv[1]
fam, edit = CONFIGS[name]
d = make(f"{name}_ext", fam, edit); sharpen(d, attn=3.0, embed=4.0)
m = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
sc = service().create_sampling_client(base_model=str(d)).result()
A = rand_ids(1500, 600, seed=21)
def hf_greedy(ids, n):
    with torch.no_grad():
        return m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
def hf_lp(ids, toks):
    full = ids + toks
    with torch.no_grad():
        lg = torch.log_softmax(m(torch.tensor([full])).logits[0].float(), -1)
    return lg[len(ids)-1:-1].gather(1, torch.tensor(toks)[:, None])[:, 0]
p = types.SamplingParams(max_tokens=16, temperature=1.0, stop=[], seed=3)
res = []
for label, ids in [("A", A), ("A again", A), ("A+700", A + rand_ids(700, 600, seed=22)), ("A[:1493]+7", A[:1493] + rand_ids(7, 600, seed=23)), ("A[:1000]", A[:1000]), ("A+700 again", A + rand_ids(700, 600, seed=22))]:
    s = sc.sample(types.ModelInput.from_ints(ids), 2, p).result().sequences
    for q in s:
        d_ = float((torch.tensor(q.logprobs) - hf_lp(ids, list(q.tokens))).abs().max())
        res.append(d_)
    print(name, label, "len", len(ids), "sampled lp vs HF (2 samples):", [round(float((torch.tensor(q.logprobs) - hf_lp(ids, list(q.tokens))).abs().max()), 7) for q in s], "mean lp", round(float(torch.tensor(s[0].logprobs).mean()), 3), flush=True)
