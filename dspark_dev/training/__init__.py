"""Training of the tiny target + DSpark drafter pair (issue 7): corpus, tokenizer, models, loop.

Everything here except the tokenizer trainer depends only on torch and the standard library, so the
training command runs on a bare GPU machine.
"""
