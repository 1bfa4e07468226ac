"""``model.arch: llama``'s torch side: the dense Llama (:mod:`.model`) and its 2D twin (:mod:`.tp2d`)."""

from parallel4d.models.build import Family
from parallel4d.models.llama import model, tp2d
from parallel4d.models.llama.spec import SPEC

FAMILY = Family(spec=SPEC, model_type=model.Llama, shape_from_config=model.shape_from_config,
                build_stage=model.build_stage, embed_2d=tp2d.TokenEmbedding2D, block_2d=tp2d.LlamaBlock2D,
                head_2d=tp2d.NormHead2D, positions="attention", rms_norms=(model.RMSNorm,),
                decode_embed=model.decode_embed, decode_block=model.decode_block)
