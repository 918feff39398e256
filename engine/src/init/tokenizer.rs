//! A byte-level BPE `tokenizer.json` for `model init` checkpoints, trained on a fixed
//! corpus (`corpus.txt`, this project's own documentation) so that the same preset
//! always gets the same tokenizer. Ids 0 and 1 are the begin/end-of-sentence tokens,
//! as in DeepSeek's tokenizer, followed by V4's chat tokens (roles, thinking markers,
//! the DSML tool-call token) so that the router can encode chats for these models; the
//! corpus supports about 2,000 merges, so a larger
//! model vocabulary leaves its upper ids unused by the tokenizer (they decode to
//! nothing).

use std::str::FromStr;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::models::{ModelWrapper, TrainerWrapper};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, TokenizerBuilder, TokenizerImpl};

pub const BOS: &str = "<｜begin▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";

/// DeepSeek-V4's chat special tokens (the spellings of its tokenizer), ids 2 onwards.
pub const CHAT_TOKENS: [&str; 6] =
    ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜", "<｜latest_reminder｜>"];

const CORPUS: &str = include_str!("corpus.txt");

type Impl = TokenizerImpl<ModelWrapper, NormalizerWrapper, PreTokenizerWrapper, PostProcessorWrapper, DecoderWrapper>;

/// `tokenizer.json` text for a vocabulary of at most `vocab_size` ids.
pub fn tokenizer_json(vocab_size: usize) -> Result<String, String> {
    let trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens([BOS, EOS].iter().chain(CHAT_TOKENS.iter()).map(|t| AddedToken::from(*t, true)).collect())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut trainer = TrainerWrapper::BpeTrainer(trainer);
    let mut tok: Impl = TokenizerBuilder::new()
        .with_model(ModelWrapper::BPE(BPE::default()))
        .with_normalizer(None)
        .with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true))))
        .with_post_processor(None)
        .with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())))
        .build()
        .map_err(|e| e.to_string())?;
    tok.train(&mut trainer, CORPUS.lines()).map_err(|e| e.to_string())?;
    let json = tok.to_string(true).map_err(|e| e.to_string())?;
    // Fail here, not at serving time, if the result does not load back.
    tokenizers::Tokenizer::from_str(&json).map_err(|e| e.to_string())?;
    Ok(json + "\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trained_tokenizer_round_trips_text_and_is_deterministic() {
        let json = tokenizer_json(8192).unwrap();
        assert_eq!(json, tokenizer_json(8192).unwrap());
        let t = tokenizers::Tokenizer::from_str(&json).unwrap();
        assert_eq!(t.token_to_id(BOS), Some(0));
        assert_eq!(t.token_to_id(EOS), Some(1));
        for (i, chat) in CHAT_TOKENS.iter().enumerate() {
            assert_eq!(t.token_to_id(chat), Some(2 + i as u32), "{chat}");
        }
        let chat = "<｜User｜>hi<｜Assistant｜></think>";
        assert_eq!(t.encode(chat, false).unwrap().get_ids().first(), Some(&2));
        let text = "Prefill workers write pages straight into the decode worker's memory. Ünïcödé ✓";
        let ids = t.encode(text, false).unwrap().get_ids().to_vec();
        assert!(ids.len() < text.len() / 2, "merges should shorten English text: {} ids", ids.len());
        assert_eq!(t.decode(&ids, false).unwrap(), text);
        let small = tokenizers::Tokenizer::from_str(&tokenizer_json(320).unwrap()).unwrap();
        assert!(small.get_vocab_size(true) <= 320);
    }
}
