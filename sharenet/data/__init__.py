"""Data: byte/token corpora, the grain training stream and evaluation batches."""
from sharenet.data.mixture import SeenRows
from sharenet.data.corpus import load_splits
from sharenet.data.corpus import unigram_bits_per_byte
from sharenet.data.corpus import vocab_size
from sharenet.data.pipeline import bytes_per_token
from sharenet.data.pipeline import checkpoint_restore_args
from sharenet.data.pipeline import checkpoint_save_args
from sharenet.data.pipeline import eval_batches
from sharenet.data.pipeline import eval_sources
from sharenet.data.pipeline import has_loss_mask
from sharenet.data.pipeline import make_train_iterator
from sharenet.data.pipeline import mixture_of
from sharenet.data.pipeline import num_eval_batches
from sharenet.data.pipeline import num_eval_tokens
from sharenet.data.pipeline import validate_data_config
