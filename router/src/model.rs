//! What the router knows about the served model: its name, vocabulary, context limit
//! and tokenizer. Read from the model directory; no weights are loaded.

use std::path::Path;

use model_spec::ModelConfig;
use model_spec::text::TextCodec;

/// Ids of the V4 chat tokens the router needs, when the tokenizer has them all.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChatTokens {
    pub eos: u32,
    pub think_end: u32,
    pub dsml: u32,
}

pub struct ModelInfo {
    pub name: String,
    pub vocab: usize,
    pub max_position: usize,
    pub codec: Option<TextCodec>,
    /// Layers and window length: what restoring a cached prefix costs depends on them.
    pub layers: usize,
    pub window: usize,
    /// V4 chat encoding: its token ids, or why this model cannot chat.
    pub chat: Result<ChatTokens, String>,
}

/// Whether `codec` can encode V4 chats, and the ids the router uses.
pub fn chat_tokens(name: &str, codec: Option<&TextCodec>) -> Result<ChatTokens, String> {
    use crate::chat::encoding::{DSML, EOS, REQUIRED_TOKENS, THINK_END};
    let Some(codec) = codec else {
        return Err(format!(
            "model `{name}` has no tokenizer.json, so it has no chat encoding; use /v1/completions with token ids"
        ));
    };
    let missing: Vec<&str> = REQUIRED_TOKENS.iter().copied().filter(|t| codec.id_of(t).is_none()).collect();
    if !missing.is_empty() {
        return Err(format!(
            "model `{name}` has no DeepSeek-V4 chat encoding: its tokenizer lacks {}; use /v1/completions",
            missing.join(" ")
        ));
    }
    let id = |t| codec.id_of(t).expect("checked above");
    Ok(ChatTokens { eos: id(EOS), think_end: id(THINK_END), dsml: id(DSML) })
}

impl ModelInfo {
    pub fn load(dir: &Path, name: String) -> Result<Self, String> {
        let cfg = ModelConfig::from_file(&dir.join("config.json")).map_err(|e| e.to_string())?;
        let codec = TextCodec::load(dir).map_err(|e| e.to_string())?;
        let chat = chat_tokens(&name, codec.as_ref());
        Ok(ModelInfo {
            chat,
            name,
            vocab: cfg.vocab_size,
            max_position: cfg.max_position,
            codec,
            layers: cfg.num_layers,
            window: cfg.window,
        })
    }
}
