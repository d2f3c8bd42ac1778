"""Write checkpoints with the code before the policy driver, the slot bank and the readers: run from a 6d26979 tree as
``PYTHONPATH=. python tests/data/pre_policies/make.py tests/data/pre_policies`` (see its README)."""
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))  # support, tiny_models
import torch  # noqa: E402

torch.set_num_threads(1)
from safetensors.torch import save_file  # noqa: E402

from hf_tta import TTAConfig, TTAWrapper  # noqa: E402
from hf_tta.routing import RoutedTTAWrapper  # noqa: E402
from hf_tta.service.tenants import TenantAdapters  # noqa: E402
from support import dense_gallery, image_stream, style_images  # noqa: E402
from tiny_models import make_model  # noqa: E402

out = sys.argv[1]
g = dense_gallery()
gate_ref = {"pixel_values": torch.cat([b["pixel_values"] for b in image_stream(4, seed=500)])}
shifted = lambda i: {"pixel_values": style_images(1, 16, 40 + i)}
scores = {}
# (a) the image default behind its gate, fitted, two shifted batches (the gate opens)
tta = TTAWrapper(make_model("clip"), TTAConfig.recommended("image", shift_gate={"statistic": "batch_mean", "threshold": 1.0}))
tta.fit_shift_gate(gate_ref)
for i in range(2):
    tta.adapt_step(shifted(i), g)
tta.save_pretrained(f"{out}/gated")
scores["gated"] = torch.cat([tta.adapt_step(shifted(10 + i), g).scores for i in range(2)])
# (b) routed by keys, two domains, with the safety layer and weight ensembling
cfg = TTAConfig(objective="tcr", lr=1e-2, query_modality="image", safety={"min_agreement": 0, "max_agreement_drop": 1},
                weight_ensemble={"momentum": 0.9})
routed = RoutedTTAWrapper(make_model("clip"), cfg)
for i, q in enumerate(image_stream(4, seed=200)):
    routed.adapt_step(q, g, domain="ab"[i % 2])
routed.save_pretrained(f"{out}/routed")
scores["routed"] = torch.cat([routed.adapt_step(q, g, domain="ab"[i % 2]).scores for i, q in enumerate(image_stream(2, seed=300))])
# (c) the service's tenants file
adapters = TenantAdapters(TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", lr=1e-2, query_modality="image")))
for i, q in enumerate(image_stream(3, seed=400)):
    adapters.adapt("xy"[i % 2], q, g)
adapters.save(f"{out}/tenants.safetensors")
scores["tenants"] = torch.cat([adapters.adapt("xy"[i % 2], q, g).scores for i, q in enumerate(image_stream(2, seed=600))])
save_file({k: v.contiguous() for k, v in scores.items()}, f"{out}/continued_scores.safetensors")
print("ok")
