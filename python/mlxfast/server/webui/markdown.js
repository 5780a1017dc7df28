// A small Markdown renderer for model replies, which are untrusted.
//
// It never builds HTML text: every piece of the model's text reaches the page
// through document.createTextNode (or textContent), and the only elements are
// the ones created here by name, so nothing the model writes is ever parsed as
// HTML. A "<script>" or "<img onerror=...>" in a reply is shown as those
// characters. Links get an href only for http:, https: and mailto: URLs.
//
// Supported: fenced code blocks (``` or ~~~, an unclosed fence runs to the
// end, as while a reply streams), ATX headings, paragraphs (a single newline
// is a line break), block quotes, ordered and unordered lists (nested by
// indentation), GFM tables, horizontal rules; inline code, **bold**,
// *italic* / _italic_, ~~strike~~, [links](https://...), bare URLs and
// backslash escapes.
"use strict";

(function (global) {
  const PUNCT = "\\`*_{}[]()#+-.!|~<>\"'";
  const SAFE_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);

  function el(tag, cls) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    return e;
  }

  function text(s) {
    return document.createTextNode(s);
  }

  function safeHref(url) {
    try {
      const u = new URL(url);
      return SAFE_PROTOCOLS.has(u.protocol) ? u.href : null;
    } catch (e) {
      return null;
    }
  }

  function link(label, href, parent) {
    const a = el("a");
    a.href = href;
    a.rel = "noopener noreferrer nofollow";
    a.target = "_blank";
    inline(label, a);
    parent.appendChild(a);
  }

  const isAlnum = (c) => c !== undefined && /[\p{L}\p{N}]/u.test(c);
  const isSpace = (c) => c === undefined || /\s/.test(c);

  // The end of a delimited span opened at i (delimiter `d`), or -1.
  function closing(src, i, d) {
    const c0 = d[0];
    const from = i + d.length;
    if (isSpace(src[from])) return -1;
    let j = from;
    while ((j = src.indexOf(d, j)) >= 0) {
      if (j > from && !isSpace(src[j - 1])) {
        if (d.length === 1 && src[j + 1] === d) { // part of a longer run: skip it
          j += 2;
          continue;
        }
        if (c0 === "_" && isAlnum(src[j + d.length])) { j += 1; continue; } // intra-word: no close
        return j;
      }
      j += 1;
    }
    return -1;
  }

  // Inline Markdown of `src`, appended to `parent` as DOM nodes.
  // Sticky (matched at lastIndex): no copy of the rest of the text per match.
  const LINK = /\[([^\]\n]*)\]\(([^()\s]*)\)/y;
  const BARE_URL = /https?:\/\/[^\s<>"'`]+/iy;

  function inline(src, parent) {
    let buf = "";
    const flush = () => {
      if (buf) parent.appendChild(text(buf));
      buf = "";
    };
    let i = 0;
    while (i < src.length) {
      const c = src[i];
      if (c === "\\" && i + 1 < src.length && PUNCT.includes(src[i + 1])) {
        buf += src[i + 1];
        i += 2;
        continue;
      }
      if (c === "\n") {
        flush();
        parent.appendChild(el("br"));
        i += 1;
        continue;
      }
      if (c === "`") {
        let n = 1;
        while (src[i + n] === "`") n += 1;
        const fence = "`".repeat(n);
        const end = src.indexOf(fence, i + n);
        if (end < 0) {
          buf += fence;
          i += n;
          continue;
        }
        let body = src.slice(i + n, end);
        if (body.length > 1 && body.startsWith(" ") && body.endsWith(" ") && body.trim()) body = body.slice(1, -1);
        flush();
        const code = el("code");
        code.textContent = body;
        parent.appendChild(code);
        i = end + n;
        continue;
      }
      if (c === "*" || c === "_" || c === "~") {
        const double = src[i + 1] === c;
        if (c === "~" && !double) {
          buf += c;
          i += 1;
          continue;
        }
        if (c === "_" && isAlnum(src[i - 1])) { // snake_case stays as is
          buf += c;
          i += 1;
          continue;
        }
        const d = double ? c + c : c;
        const end = closing(src, i, d);
        if (end < 0) {
          buf += d;
          i += d.length;
          continue;
        }
        flush();
        const tag = c === "~" ? "del" : double ? "strong" : "em";
        const e = el(tag);
        inline(src.slice(i + d.length, end), e);
        parent.appendChild(e);
        i = end + d.length;
        continue;
      }
      if (c === "[") {
        LINK.lastIndex = i;
        const m = LINK.exec(src);
        const href = m ? safeHref(m[2]) : null;
        if (m && href) {
          flush();
          link(m[1] || m[2], href, parent);
          i += m[0].length;
          continue;
        }
      }
      if ((c === "h" || c === "H") && !isAlnum(src[i - 1])) {
        BARE_URL.lastIndex = i;
        const m = BARE_URL.exec(src);
        if (m) {
          let end = m[0].length; // trailing punctuation ends the sentence, not the address
          while (end > 0 && ".,;:!?)]".includes(m[0][end - 1])) end -= 1;
          const url = m[0].slice(0, end);
          const href = safeHref(url);
          if (href) {
            flush();
            const a = el("a");
            a.href = href;
            a.rel = "noopener noreferrer nofollow";
            a.target = "_blank";
            a.textContent = url;
            parent.appendChild(a);
            i += url.length;
            continue;
          }
        }
      }
      buf += c;
      i += 1;
    }
    flush();
  }

  // No two adjacent quantifiers here may match the same characters: a
  // regex that can split a run of spaces many ways backtracks for seconds
  // on a long line, and the reply is drawn again every few tens of ms.
  const FENCE_OPEN = /^ {0,3}(`{3,}|~{3,})(.*)$/;
  const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*))?$/;
  const HR = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_SEP = /^\|?[ \t]*:?-+:?[ \t]*(\|[ \t]*:?-+:?[ \t]*)*\|?$/; // on the trimmed line
  const MAX_DEPTH = 16; // block quotes and lists nested deeper are drawn as text

  // A fence's opening (and its language), or null: a backtick fence's info
  // string has no backtick.
  function fenceOpen(line) {
    const m = FENCE_OPEN.exec(line);
    if (!m || (m[1][0] === "`" && m[2].includes("`"))) return null;
    return { fence: m[1], lang: m[2].trim().split(/\s/)[0] };
  }

  // A heading's text: CommonMark's closing run of #s (after a space) and
  // the spaces around it are not part of it.
  function headingText(text) {
    let end = text.length;
    while (end > 0 && (text[end - 1] === " " || text[end - 1] === "\t")) end -= 1;
    let k = end;
    while (k > 0 && text[k - 1] === "#") k -= 1;
    if (k < end && (k === 0 || text[k - 1] === " " || text[k - 1] === "\t")) {
      end = k;
      while (end > 0 && (text[end - 1] === " " || text[end - 1] === "\t")) end -= 1;
    }
    return text.slice(0, end);
  }

  function cells(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    const out = [];
    let cur = "";
    for (let i = 0; i < s.length; i++) {
      if (s[i] === "\\" && s[i + 1] === "|") {
        cur += "|";
        i += 1;
      } else if (s[i] === "|") {
        out.push(cur.trim());
        cur = "";
      } else {
        cur += s[i];
      }
    }
    out.push(cur.trim());
    return out;
  }

  function codeBlock(lang, body, parent) {
    const wrap = el("div", "code-block");
    const bar = el("div", "code-bar");
    const name = el("span", "code-lang");
    name.textContent = lang;
    const copy = el("button", "copy");
    copy.type = "button";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => {
      if (navigator.clipboard) navigator.clipboard.writeText(body).catch(() => {});
    });
    bar.append(name, copy);
    const pre = el("pre");
    const code = el("code");
    if (lang) code.dataset.lang = lang;
    code.textContent = body;
    pre.appendChild(code);
    wrap.append(bar, pre);
    parent.appendChild(wrap);
  }

  function startsBlock(line) {
    return fenceOpen(line) !== null || HEADING.test(line) || HR.test(line) || QUOTE.test(line) || ITEM.test(line);
  }

  // Block Markdown of `lines`, appended to `parent`, `depth` quotes and
  // lists deep.
  function blocks(lines, parent, depth = 0) {
    if (depth > MAX_DEPTH) {
      const p = el("p");
      p.textContent = lines.join("\n");
      parent.appendChild(p);
      return;
    }
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) {
        i += 1;
        continue;
      }
      let m;
      const open = fenceOpen(line);
      if (open) {
        const fence = open.fence;
        const body = [];
        i += 1;
        while (i < lines.length) {
          const t = lines[i].trim();
          if (t.startsWith(fence[0].repeat(fence.length)) && /^[`~]+$/.test(t)) break;
          body.push(lines[i]);
          i += 1;
        }
        i += 1; // the closing fence (or the end)
        codeBlock(open.lang, body.join("\n"), parent);
        continue;
      }
      if ((m = HEADING.exec(line))) {
        const h = el("h" + m[1].length);
        inline(headingText(m[2] || ""), h);
        parent.appendChild(h);
        i += 1;
        continue;
      }
      if (HR.test(line)) {
        parent.appendChild(el("hr"));
        i += 1;
        continue;
      }
      if (QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
          body.push(m[1]);
          i += 1;
        }
        const q = el("blockquote");
        blocks(body, q, depth + 1);
        parent.appendChild(q);
        continue;
      }
      if ((m = ITEM.exec(line))) {
        const indent = m[1].length;
        const ordered = /\d/.test(m[2]);
        const list = el(ordered ? "ol" : "ul");
        if (ordered && parseInt(m[2], 10) !== 1) list.start = parseInt(m[2], 10);
        let item = null;
        while (i < lines.length) {
          const l = lines[i];
          const im = ITEM.exec(l);
          if (im && im[1].length <= indent + 1 && /\d/.test(im[2]) === ordered) {
            item = [im[3]];
            list.appendChild(el("li"))._md = item;
            i += 1;
          } else if (item && l.trim() && (/^\s/.test(l) || !startsBlock(l))) {
            item.push(l.replace(new RegExp("^ {0," + (indent + 4) + "}"), ""));
            i += 1;
          } else if (item && !l.trim() && i + 1 < lines.length && /^\s+\S/.test(lines[i + 1])) {
            item.push("");
            i += 1;
          } else {
            break;
          }
        }
        for (const li of list.children) {
          const body = li._md;
          delete li._md;
          if (body.length === 1 || !body.slice(1).some((l) => startsBlock(l) || !l.trim())) {
            inline(body.join("\n"), li);
          } else {
            blocks(body, li, depth + 1);
          }
        }
        parent.appendChild(list);
        continue;
      }
      if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1].trim()) && lines[i + 1].includes("-")) {
        const head = cells(line);
        const aligns = cells(lines[i + 1]).map((c) =>
          c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "");
        const table = el("table");
        const thead = el("thead");
        const tr = el("tr");
        head.forEach((c, k) => {
          const th = el("th");
          if (aligns[k]) th.style.textAlign = aligns[k];
          inline(c, th);
          tr.appendChild(th);
        });
        thead.appendChild(tr);
        table.appendChild(thead);
        const tbody = el("tbody");
        i += 2;
        while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
          const row = el("tr");
          const cs = cells(lines[i]);
          for (let k = 0; k < head.length; k++) {
            const td = el("td");
            if (aligns[k]) td.style.textAlign = aligns[k];
            inline(cs[k] || "", td);
            row.appendChild(td);
          }
          tbody.appendChild(row);
          i += 1;
        }
        table.appendChild(tbody);
        const wrap = el("div", "table-wrap");
        wrap.appendChild(table);
        parent.appendChild(wrap);
        continue;
      }
      const para = [];
      while (i < lines.length && lines[i].trim() && (para.length === 0 || !startsBlock(lines[i]))) {
        para.push(lines[i]);
        i += 1;
      }
      const p = el("p");
      inline(para.join("\n"), p);
      parent.appendChild(p);
    }
  }

  // The Markdown `src` as a DocumentFragment (never HTML text); should a
  // construct defeat the renderer, the text as it is.
  function render(src) {
    const frag = document.createDocumentFragment();
    try {
      blocks(String(src).replace(/\r\n?/g, "\n").split("\n"), frag);
    } catch (e) {
      const p = el("p");
      p.textContent = String(src);
      frag.replaceChildren(p);
    }
    return frag;
  }

  global.MlxMarkdown = Object.freeze({ render, inline, safeHref });
})(window);
