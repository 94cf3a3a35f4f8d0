"""The demo model's data: a seeded synthetic corpus of bilingual business chats, and the calibration requests.

Stdlib only, so the corpus can be generated (and the calibration file checked) without torch.
"""
