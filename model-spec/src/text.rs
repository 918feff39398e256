//! Text ↔ token ids with a model directory's `tokenizer.json` (Hugging Face
//! `tokenizers`), and streaming detokenisation that never emits half a character.

use std::path::Path;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum TextError {
    #[error("cannot load {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("tokenizer failed: {0}")]
    Tokenizer(String),
}

pub struct TextCodec {
    tok: tokenizers::Tokenizer,
}

impl TextCodec {
    /// The model directory's tokenizer, or `None` when it has no `tokenizer.json`
    /// (such a model accepts token ids only).
    pub fn load(model_dir: &Path) -> Result<Option<Self>, TextError> {
        let path = model_dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let tok = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| TextError::Load { path: path.display().to_string(), reason: e.to_string() })?;
        Ok(Some(TextCodec { tok }))
    }

    /// Token ids of `text`, without adding special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        Ok(self.tok.encode(text, false).map_err(|e| TextError::Tokenizer(e.to_string()))?.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        self.tok.decode(ids, false).map_err(|e| TextError::Tokenizer(e.to_string()))
    }

    /// Text of one token on its own (for top-logprob alternatives).
    pub fn token_text(&self, id: u32) -> String {
        self.decode(&[id]).unwrap_or_default()
    }

    pub fn id_of(&self, token: &str) -> Option<u32> {
        self.tok.token_to_id(token)
    }
}

/// Turns a stream of token ids into text deltas. Byte-level tokens can split a
/// character across tokens, so text ending in an incomplete character (decoded as
/// U+FFFD) is held back until the rest arrives. Only a short window of recent tokens is
/// re-decoded per step, so cost does not grow with the length of the output.
#[derive(Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    /// Start of the window that gives context for decoding the new tokens.
    prefix: usize,
    /// Tokens whose text has been emitted.
    read: usize,
}

impl Detokenizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a token; returns the text it completes (possibly empty).
    pub fn push(&mut self, codec: &TextCodec, id: u32) -> Result<String, TextError> {
        self.ids.push(id);
        let before = codec.decode(&self.ids[self.prefix..self.read])?;
        let now = codec.decode(&self.ids[self.prefix..])?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&before) {
            let delta = now[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Text of tokens still held back (call once the stream ends).
    pub fn flush(&mut self, codec: &TextCodec) -> Result<String, TextError> {
        let before = codec.decode(&self.ids[self.prefix..self.read])?;
        let now = codec.decode(&self.ids[self.prefix..])?;
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(now.strip_prefix(before.as_str()).unwrap_or("").to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn codec() -> TextCodec {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/golden/tiny-init/model");
        TextCodec::load(&dir).unwrap().expect("fixture has a tokenizer")
    }

    #[test]
    fn streaming_deltas_concatenate_to_the_full_text() {
        let c = codec();
        let text = "Pages land in the decode worker — naïve café ✓ 東京";
        let ids = c.encode(text).unwrap();
        let mut d = Detokenizer::new();
        let mut out = String::new();
        for &id in &ids {
            let delta = d.push(&c, id).unwrap();
            assert!(!delta.contains('\u{FFFD}'), "emitted half a character");
            out.push_str(&delta);
        }
        out.push_str(&d.flush(&c).unwrap());
        assert_eq!(out, text);
    }

    #[test]
    fn models_without_tokenizer_load_as_none() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek-v4-flash");
        assert!(TextCodec::load(&dir).unwrap().is_none());
    }
}
