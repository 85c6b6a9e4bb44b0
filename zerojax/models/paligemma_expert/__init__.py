"""PaliGemma with an action expert: the body π0 and π0.5 share (neither family is built on the other).

    model.py     the joint layer (Gemma or adaptive expert norms) and the PaliGemmaWithExpert base
    lerobot.py   its LeRobot checkpoint names (PaliGemmaWithExpertModel), read and written for both
    openpi.py    its openpi `params/` tree rules (PaliGemma and the expert)
"""
