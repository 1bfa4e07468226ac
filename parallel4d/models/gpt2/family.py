"""``model.arch: gpt2``'s torch side: the dense GPT (:mod:`.model`) and its 2D twin (:mod:`.tp2d`)."""

from parallel4d.models.build import Family
from parallel4d.models.gpt2 import model, tp2d
from parallel4d.models.gpt2.spec import SPEC

FAMILY = Family(spec=SPEC, model_type=model.GPT, shape_from_config=model.shape_from_config,
                build_stage=model.build_stage, embed_2d=tp2d.TokenPositionEmbedding2D, block_2d=tp2d.Block2D,
                head_2d=tp2d.Head2D, positions="embedding", rms_norms=(), decode_embed=model.decode_embed,
                decode_block=model.decode_block)
