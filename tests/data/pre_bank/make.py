"""Write an lr-search checkpoint mid-probe with the code before its shadows moved into the slot bank: run from a
c40d6a8 tree as ``PYTHONPATH=. python tests/data/pre_bank/make.py tests/data/pre_bank`` (see its README)."""
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))  # support, tiny_models
import torch  # noqa: E402

torch.set_num_threads(1)
from safetensors.torch import save_file  # noqa: E402

from hf_tta import TTAConfig, TTAWrapper  # noqa: E402
from support import batch  # noqa: E402
from tiny_models import make_model  # noqa: E402

out = sys.argv[1]
cfg = TTAConfig(objective="tcr", query_modality="image", steps=2,
                lr_search={"candidates": [1e-3, 1e-2, 1e-1], "probe_batches": 4, "serve": "leader"})
tta = TTAWrapper(make_model("clip"), cfg)
g = tta.encode_gallery(batch("text", 20, seed=1))
stream = [batch("image", 8, seed=70 + i) for i in range(6)]
for x in stream[:2]:  # two of the four probe batches: three shadows in the checkpoint
    tta.adapt_step(x, g)
tta.save_pretrained(f"{out}/mid_probe")
outs = [tta.adapt_step(x, g) for x in stream[2:]]
save_file({"scores": torch.cat([o.scores for o in outs]).contiguous(),
           "chosen": torch.tensor(tta.lr_search.chosen, dtype=torch.float64)}, f"{out}/continued.safetensors")
print("ok", tta.lr_search.chosen)
