"""The GPT trainer's model against PyTorch: runs `test_gpt_grad dump`, rebuilds the same model in
torch (float64) from the dumped weights and tokens, and compares the loss and every gradient
(||c - torch|| / ||torch|| <= 1e-4 per tensor). Exit 77 (skipped) without torch."""
import math
import os
import struct
import subprocess
import sys
import tempfile

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("torch not available: skipped")
    sys.exit(77)

exe = sys.argv[1]
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "gpt.bin")
    subprocess.run([exe, "dump", path], check=True)
    raw = open(path, "rb").read()

L, NH, C, CTX, B, T = struct.unpack_from("<6q", raw, 0)
off = 48
tok = torch.tensor(struct.unpack_from(f"<{B*T}i", raw, off), dtype=torch.long).view(B, T)
off += 4 * B * T
tgt = torch.tensor(struct.unpack_from(f"<{B*T}i", raw, off), dtype=torch.long).view(B, T)
off += 4 * B * T
V = 256
shapes = [("wte", (V, C)), ("wpe", (CTX, C))]
for l in range(L):
    shapes += [(f"h{l}.ln1.weight", (C,)), (f"h{l}.ln1.bias", (C,)),
               (f"h{l}.attn.qkv.weight", (3 * C, C)), (f"h{l}.attn.qkv.bias", (3 * C,)),
               (f"h{l}.attn.proj.weight", (C, C)), (f"h{l}.attn.proj.bias", (C,)),
               (f"h{l}.ln2.weight", (C,)), (f"h{l}.ln2.bias", (C,)),
               (f"h{l}.mlp.fc.weight", (4 * C, C)), (f"h{l}.mlp.fc.bias", (4 * C,)),
               (f"h{l}.mlp.proj.weight", (C, 4 * C)), (f"h{l}.mlp.proj.bias", (C,))]
shapes += [("lnf.weight", (C,)), ("lnf.bias", (C,))]
n = sum(math.prod(s) for _, s in shapes)
flat = torch.tensor(struct.unpack_from(f"<{n}f", raw, off), dtype=torch.float64)
off += 4 * n
(c_loss,) = struct.unpack_from("<d", raw, off)
off += 8
c_grads = torch.tensor(struct.unpack_from(f"<{n}f", raw, off), dtype=torch.float64)

params, pos = {}, 0
for name, shape in shapes:
    k = math.prod(shape)
    params[name] = flat[pos:pos + k].view(shape).clone().requires_grad_(True)
    pos += k
p = params
hs = C // NH
x = p["wte"][tok] + p["wpe"][:T]
mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
for l in range(L):
    h = F.layer_norm(x, (C,), p[f"h{l}.ln1.weight"], p[f"h{l}.ln1.bias"], eps=1e-5)
    qkv = h @ p[f"h{l}.attn.qkv.weight"].T + p[f"h{l}.attn.qkv.bias"]
    q, k, v = qkv.split(C, dim=2)
    q = q.view(B, T, NH, hs).transpose(1, 2)
    k = k.view(B, T, NH, hs).transpose(1, 2)
    v = v.view(B, T, NH, hs).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    y = (att @ v).transpose(1, 2).reshape(B, T, C)
    x = x + y @ p[f"h{l}.attn.proj.weight"].T + p[f"h{l}.attn.proj.bias"]
    h = F.layer_norm(x, (C,), p[f"h{l}.ln2.weight"], p[f"h{l}.ln2.bias"], eps=1e-5)
    h = F.gelu(h @ p[f"h{l}.mlp.fc.weight"].T + p[f"h{l}.mlp.fc.bias"], approximate="tanh")
    x = x + h @ p[f"h{l}.mlp.proj.weight"].T + p[f"h{l}.mlp.proj.bias"]
x = F.layer_norm(x, (C,), p["lnf.weight"], p["lnf.bias"], eps=1e-5)
logits = x @ p["wte"].T
loss = F.cross_entropy(logits.view(-1, V), tgt.view(-1))
loss.backward()

failed = False
rel = abs(c_loss - loss.item()) / abs(loss.item())
print(f"loss: C {c_loss:.8f} torch {loss.item():.8f} rel error {rel:.2e}")
failed |= not rel <= 1e-4
pos = 0
for name, shape in shapes:
    k = math.prod(shape)
    g_c = c_grads[pos:pos + k]
    g_t = p[name].grad.reshape(-1)
    pos += k
    den = g_t.norm().item()
    err = (g_c - g_t).norm().item() / den if den > 0 else (g_c - g_t).norm().item()
    bad = not err <= 1e-4
    failed |= bad
    print(f"{name:24s} rel error {err:.2e}{'  FAIL' if bad else ''}")
sys.exit(1 if failed else 0)
